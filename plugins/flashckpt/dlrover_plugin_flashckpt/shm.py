"""Shared-memory buffers ("slots") of the flash saver, and their header protocol.

One slot is one POSIX shared-memory file ``<shm_dir>/<name>`` (``/dev/shm``), laid
out as::

    [0, 4096)              header: fixed binary fields (struct ``_HDR``) at 0, and the
                           identity block (JSON: job, role, rank, dir, session, run)
                           at 512
    [4096, 4096+meta_cap)  meta block: tensor table + skeleton of the last save (tagged
                           JSON with a magic, version and crc32: ``meta.pack_meta``;
                           never unpickled)
    [data_offset, ...)     data area: the tensors' raw bytes (see ``layout``)

Names: ``dlrflash-<job>-<key>-r<rank>-s<slot>`` where ``key`` is a digest of the
checkpoint directory (which already names the role), so two jobs or two test
sessions on one machine never share a buffer.

Trust: a buffer is created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` and mode 0600 under a
random temp name, then renamed into place; :meth:`Segment.attach` opens with
``O_NOFOLLOW`` and refuses (:class:`ShmTrustError`) a file that is not a regular file
owned by this user with mode 0600, or whose header has another magic or version. Nothing
read from a buffer is unpickled, so a file planted in ``/dev/shm`` by another user can
neither be attached nor run code.

Slot states (``state`` field), changed only under the slot's lock (``flock`` on the
file plus a thread lock), so a trainer and the node's persister never race:

    EMPTY --save--> WRITING --copy done--> READY --persister claims--> PERSISTING
      ^                ^                     |                            |
      |                +-------save----------+          <--written--------+
    created

A save never takes a PERSISTING slot whose persister is alive (the header holds the
persister's pid and process start time; a dead persister's claim is void). A
WRITING slot whose writer died is garbage and is never loaded nor persisted. ``seq``
grows by one at every save into the slot; a reader checks it again after copying to
detect a concurrent overwrite.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Iterator

# re-exported: the buffers' users reach these through ``shm``
from dlrover_plugin_flashckpt.identity import alive, my_identity, proc_start  # noqa: F401
from dlrover_plugin_flashckpt.pinning import (  # noqa: F401
    pin_buffers,
    prefault_write,
    unpin_buffers,
)
from dlrover_plugin_flashckpt.space import (  # noqa: F401
    ShmSpaceError,
    check_space,
    gib,
    shm_free_bytes,
)

MAGIC = b"DLRFLSH1"
VERSION = 1
HEADER_SIZE = 4096
IDENT_OFFSET = 512
PAGE = 4096

EMPTY, WRITING, READY, PERSISTING = 0, 1, 2, 3
STATE_NAMES = {EMPTY: "empty", WRITING: "writing", READY: "ready", PERSISTING: "persisting"}

NAME_PREFIX = "dlrflash-"
_SAFE_RE = re.compile(r"[^A-Za-z0-9_.]+")


class ShmTrustError(PermissionError):
    """A file at a buffer's path is not one this user's flash saver made: a symlink, not
    a regular file, owned by another user, a mode other than 0600, or a header of another
    magic or version. The message names the path, what was found and what to do."""


def check_trusted(path: str, st: os.stat_result) -> None:
    """Raise :class:`ShmTrustError` unless ``st`` (``fstat`` of ``path``) is a regular file
    of the current user with mode 0600."""
    import stat as stat_mod

    problem = None
    if not stat_mod.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif stat_mod.S_IMODE(st.st_mode) != 0o600:
        problem = f"has mode {stat_mod.S_IMODE(st.st_mode):04o}, not 0600"
    if problem:
        raise ShmTrustError(
            f"flash buffer {path} {problem}: the flash saver only maps buffers it created "
            "(owner-only, mode 0600); remove the file if it is yours, or report it: another "
            "user may have planted it")


@dataclass
class Header:
    """The binary header of a slot (see the module docstring for the protocol).

    Attributes:
        state: EMPTY/WRITING/READY/PERSISTING. seq: saves into this slot so far.
        step: the step held (-1: none). meta_len/meta_crc: length and crc32 of the meta
        block. data_len: bytes of the data area in use. meta_cap/data_cap/data_offset:
        the layout. writer_pid/writer_start: the trainer process that wrote last (pid,
        process start time in clock ticks). persister_pid/persister_start: the persister
        holding a PERSISTING claim. data_crc/crc_seq: crc32 of the data area, computed by
        the persister for save number ``crc_seq`` (0: none). persisted_seq: the save
        number last written to the checkpoint directory. saved_at: unix time of the save.
        due: 1 when the save is due for persistence. sig: layout signature (16 bytes).
    """

    magic: bytes = MAGIC
    version: int = VERSION
    state: int = EMPTY
    seq: int = 0
    step: int = -1
    meta_len: int = 0
    meta_crc: int = 0
    data_len: int = 0
    meta_cap: int = 0
    data_cap: int = 0
    data_offset: int = 0
    writer_pid: int = 0
    writer_start: int = 0
    persister_pid: int = 0
    persister_start: int = 0
    data_crc: int = 0
    crc_seq: int = 0
    persisted_seq: int = 0
    saved_at: float = 0.0
    rank: int = 0
    world_size: int = 1
    due: int = 0
    sig: bytes = b"\0" * 16


_HDR = struct.Struct("<8sIIQqQIQQQQIQIQIQQdIII16s")
_FIELDS = [f.name for f in fields(Header)]


def safe_name(s: str, limit: int = 40) -> str:
    return _SAFE_RE.sub("_", s)[:limit] or "_"


def dir_key(directory: str) -> str:
    """10-hex digest of the absolute checkpoint directory."""
    return hashlib.sha1(os.path.abspath(directory).encode()).hexdigest()[:10]


def job_prefix(job: str) -> str:
    """Name prefix of every buffer of ``job``."""
    return f"{NAME_PREFIX}{safe_name(job)}-"


def slot_name(job: str, directory: str, rank: int, slot: int) -> str:
    return f"{job_prefix(job)}{dir_key(directory)}-r{rank:05d}-s{slot}"


def round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to



class Segment:
    """One slot buffer, mapped into this process.

    Create with :meth:`create` or :meth:`attach`; the mapping is shared, writes are
    seen at once by every process that maps the same file.
    """

    def __init__(self, path: str, fd: int, mm: mmap.mmap, size: int,
                 populated: bool = False) -> None:
        self.path = path
        self.target = path
        #: the page tables were filled at mapping time (MAP_POPULATE)
        self.populated = populated
        self.name = os.path.basename(path)
        self.fd = fd
        self.mm = mm
        self.size = size
        self.inode = os.fstat(fd).st_ino
        self._tlock = threading.RLock()

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def create(cls, path: str, meta_cap: int, data_cap: int, ident: dict, sig: bytes,
               rank: int, world_size: int, populate: bool = True,
               install: bool = True) -> Segment:
        """Create (or replace) the buffer at ``path``: a temp file is sized with
        ``posix_fallocate`` (so a full tmpfs fails here, not with SIGBUS later; this
        allocates and zeroes every page, the slow part), mapped (``MAP_POPULATE``: page
        tables filled), given its header, then renamed into place. With
        ``install=False`` it stays at its temp path until :meth:`install`.

        Raises:
            ShmSpaceError: the tmpfs is full.
        """
        meta_cap = round_up(meta_cap)
        data_offset = HEADER_SIZE + meta_cap
        size = data_offset + round_up(max(data_cap, 1))
        # unique per call: two threads of one process may lay out the same slot at once
        tmp = f"{path}.{os.urandom(4).hex()}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise ShmSpaceError(
                        f"flash checkpoint could not reserve {gib(size)} in "
                        f"{os.path.dirname(path)} ({gib(shm_free_bytes(os.path.dirname(path)))}"
                        " free); enlarge it or set checkpoint.options.slots=1") from None
                raise
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mm = mmap.mmap(fd, size, flags=flags)
            if populate:
                prefault_write(mm, HEADER_SIZE, size - HEADER_SIZE)
            seg = cls(tmp, fd, mm, size, populate)
            blob = json.dumps(ident, sort_keys=True).encode()
            if len(blob) > HEADER_SIZE - IDENT_OFFSET - 4:
                raise ValueError(f"identity block too long ({len(blob)} bytes)")
            mm[IDENT_OFFSET:IDENT_OFFSET + 4] = struct.pack("<I", len(blob))
            mm[IDENT_OFFSET + 4:IDENT_OFFSET + 4 + len(blob)] = blob
            wpid, wstart = my_identity()
            seg.write_header(Header(meta_cap=meta_cap, data_cap=size - data_offset,
                                    data_offset=data_offset, rank=rank, world_size=world_size,
                                    sig=sig, writer_pid=wpid, writer_start=wstart))
            seg.target = path
            if install:
                seg.install()
            return seg
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            os.close(fd)
            raise

    @classmethod
    def attach(cls, path: str, populate: bool = False) -> Segment | None:
        """Map an existing buffer; ``None`` when it is missing or too short to be one.

        Raises:
            ShmTrustError: ``path`` is a symlink, not a regular file, not owned by this
                user, not mode 0600, or its header has another magic or version.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ShmTrustError(f"flash buffer {path} is a symbolic link: the flash saver "
                                    "never follows one; remove it (another user may have "
                                    "planted it)") from None
            return None
        try:
            st = os.fstat(fd)
            check_trusted(path, st)
            size = st.st_size
            if size < HEADER_SIZE:
                os.close(fd)
                return None
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            mm = mmap.mmap(fd, size, flags=flags)
        except ShmTrustError:
            os.close(fd)
            raise
        except OSError:
            os.close(fd)
            return None
        magic, version = struct.unpack_from("<8sI", mm, 0)
        if magic != MAGIC or version != VERSION:
            mm.close()
            os.close(fd)
            raise ShmTrustError(f"flash buffer {path} has magic {magic!r} version {version}, "
                                f"not {MAGIC!r} version {VERSION}: not a buffer of this flash "
                                "saver; remove it")
        return cls(path, fd, mm, size, populate)

    def install(self) -> None:
        """Rename a buffer made with ``create(install=False)`` to its final path
        (atomically replacing the buffer there)."""
        os.rename(self.path, self.target)
        self.path, self.name = self.target, os.path.basename(self.target)

    @property
    def data_cap(self) -> int:
        """Bytes the data area can hold."""
        return self.size - self.read_header().data_offset

    def replaced(self) -> bool:
        """Whether the file at :attr:`path` is no longer the one mapped here."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except OSError:
            return True

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # tensors still view it; the mapping goes with them
        try:
            os.close(self.fd)
        except OSError:
            pass

    def unlink(self) -> None:
        try:
            if not self.replaced():
                os.unlink(self.path)
        except OSError:
            pass

    # ------------------------------------------------------------------ header
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive access to the header among threads and processes."""
        with self._tlock:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def read_header(self) -> Header:
        vals = _HDR.unpack_from(self.mm, 0)
        return Header(**dict(zip(_FIELDS, vals)))

    def write_header(self, h: Header) -> None:
        _HDR.pack_into(self.mm, 0, *(getattr(h, f) for f in _FIELDS))

    def ident(self) -> dict:
        (n,) = struct.unpack_from("<I", self.mm, IDENT_OFFSET)
        try:
            return json.loads(bytes(self.mm[IDENT_OFFSET + 4:IDENT_OFFSET + 4 + n]))
        except ValueError:
            return {}

    # ------------------------------------------------------------------ blocks
    def meta_bytes(self, h: Header) -> bytes:
        return bytes(self.mm[HEADER_SIZE:HEADER_SIZE + h.meta_len])

    def write_meta(self, blob: bytes) -> None:
        self.mm[HEADER_SIZE:HEADER_SIZE + len(blob)] = blob

    def data_view(self, h: Header) -> memoryview:
        return memoryview(self.mm)[h.data_offset:h.data_offset + h.data_len]


def persister_alive(h: Header) -> bool:
    return alive(h.persister_pid, h.persister_start)


def effective_state(h: Header) -> int:
    """The state with void claims resolved: a PERSISTING claim of a dead persister is
    READY; a WRITING slot whose writer is gone stays WRITING (garbage)."""
    if h.state == PERSISTING and not persister_alive(h):
        return READY
    return h.state


def holds_step(h: Header) -> bool:
    """The slot holds a complete save (READY, or being persisted)."""
    return h.magic == MAGIC and effective_state(h) in (READY, PERSISTING) and h.step >= 0


def list_segments(shm_dir: str, prefix: str = NAME_PREFIX) -> list[str]:
    """Paths of flash buffers (and left-over temp files) in ``shm_dir``."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    return sorted(os.path.join(shm_dir, n) for n in names if n.startswith(prefix))


def tmp_owner(path: str) -> int | None:
    """The pid in the name of a temp buffer (``...tmp-<pid>``), else ``None``."""
    m = re.search(r"\.tmp-(\d+)$", path)
    return int(m.group(1)) if m else None


def file_age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0
