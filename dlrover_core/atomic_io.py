"""Atomic, durable file writes for job state (``summary.json``, the driver's state):
write a temp file in the same directory, fsync it, rename it over the target, fsync
the directory. A crash leaves either the old file or the new one, never a torn one.

Checksummed payloads (:func:`write_checksummed` / :func:`read_checksummed`) carry a
sha256 line so that a reader can tell a complete file from a corrupt one.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` (makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync dir."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(d)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def write_checksummed(path: str, payload: bytes) -> None:
    """Write ``<sha256 hex>\\n<payload>`` to ``path`` atomically."""
    atomic_write_bytes(path, hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


def read_checksummed(path: str) -> bytes | None:
    """The payload :func:`write_checksummed` wrote, or ``None`` when ``path`` does not
    exist.

    Raises:
        ValueError: the sha256 line does not match the payload (a corrupt file),
            naming the path.
    """
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        digest, _, payload = f.read().partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError(f"{path}: sha256 of the payload does not match its header line "
                         "(a torn or corrupt file)")
    return payload


def write_all(f: Any, data: bytes | memoryview) -> int:
    """Write every byte of ``data`` to the raw file ``f`` (an unbuffered ``FileIO``):
    ``FileIO.write`` may write fewer bytes than asked (a signal, FUSE, NFS), so this
    loops on the rest. Returns the bytes written (``len(data)``).

    Raises:
        OSError: ``f.write`` wrote nothing (``0`` or ``None``: a non-blocking file
            that is not ready); a full disk raises ``ENOSPC`` from ``f.write`` itself.
    """
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = f.write(view[done:])
        if not n:
            raise OSError(f"write to {getattr(f, 'name', f)!r} wrote nothing at byte {done} "
                          f"of {len(view)}")
        done += n
    return done


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``); ``False`` where the C library or the filesystem lacks it."""
    import ctypes
    import errno

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False  # e.g. NFS, some FUSE filesystems, seccomp
    raise OSError(err, os.strerror(err), a)


def aside_name(path: str) -> str:
    """Where :func:`replace_dir` keeps the old ``path`` on a filesystem without an
    atomic exchange, between its two renames."""
    return path.rstrip("/") + ".replaced"


def replace_dir(src: str, dst: str) -> str | None:
    """Move the directory ``src`` to ``dst``, replacing a ``dst`` that exists, so that
    at every moment either the old or the new ``dst`` is complete and can be found.

    Design: a new ``dst`` is one ``rename``. An existing one is swapped with ``src``
    in one step (``renameat2(RENAME_EXCHANGE)``, Linux >= 3.15 on ext4, xfs, btrfs,
    tmpfs); afterwards ``src`` holds the old directory. Where that is not supported
    (NFS, macOS), the old ``dst`` is first renamed to :func:`aside_name` and then
    ``src`` to ``dst``: between the two renames a reader finds the old copy there
    (:func:`recover_aside` puts it back after a crash). ``fsync``s the parent.

    Returns the path now holding the old directory (the caller removes it), or
    ``None`` when ``dst`` did not exist.
    """
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.exists(dst):
        os.rename(src, dst)
        fsync_dir(parent)
        return None
    if _exchange(src, dst):
        fsync_dir(parent)
        return src
    aside = aside_name(dst)
    if os.path.exists(aside):
        import shutil

        shutil.rmtree(aside)  # a finished replacement's leftover (dst is complete)
    os.rename(dst, aside)
    try:
        os.rename(src, dst)
    except OSError:
        recover_aside(dst)  # a reader put the old copy back first: it stays
        raise
    fsync_dir(parent)
    return aside


def recover_aside(dst: str) -> bool:
    """After a crash between :func:`replace_dir`'s two renames (or while one is
    between them: its second rename then fails and the old copy stays): put the old
    copy back when ``dst`` is missing. Returns whether it did."""
    aside = aside_name(dst)
    if os.path.isdir(aside) and not os.path.exists(dst):
        try:
            os.rename(aside, dst)
        except OSError:
            return False
        return True
    return False
