"""Reading saved tensor bytes straight into live tensors with ``pread``.

A load copies every saved byte once, from a shared-memory buffer or a checkpoint file
into the live tensor (a model parameter, an optimizer state tensor). Mapping the buffer
first would cost a page-table entry per 4 KiB page in the reading process (a fresh,
restarted process has none) before the copy; ``os.preadv`` into the live tensor's own
memory lets the kernel copy from its page cache without mapping the source at all, and
the same code reads a checkpoint file on disk. Large reads are split in chunks spread
over a few threads (``preadv`` releases the GIL), and :meth:`ShardReader.submit` lets a
load start the reads of every tensor before it waits for them.

A process that already holds a populated mapping of the buffer (its own saves went
through it, or a standby premapped it) copies from the mapping instead
(:meth:`ShardReader.copy_from`): the copies of one load are cut in pieces that the
calling thread and the reader's threads take one at a time (``Tensor.copy_`` releases
the GIL).
Measured on this project's 2-CPU VM in a Ray actor (``OMP_NUM_THREADS=1``, 16 tensors
from a ``/dev/shm`` mapping, medians of 25): 64 MiB in 5.6 ms on one thread, 4.5 ms on
two; 512 MiB in 42.5 and 34.9 ms (a single-thread ``Tensor.copy_`` between private
tensors: 5.9 and 45.5 ms). Where one thread already copies at the memory's speed (the
flash benchmark's loads at 512 MiB on that VM) the second adds nothing
(docs/flash-checkpoint.md, issue 55's figures).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_plugin_flashckpt import shm

if TYPE_CHECKING:
    import torch

#: bytes per ``preadv`` call when a read is split over threads
CHUNK = 32 << 20
#: a read_into() smaller than this runs in the calling thread
PARALLEL_MIN = 64 << 20
#: a submit() smaller than this runs in the calling thread
INLINE_MAX = 1 << 20
#: copies of one load (copy_from) totalling less than this run in the calling thread
COPY_PARALLEL_MIN = 4 << 20
#: bytes per piece of a copy_from() that the threads take one at a time (a multiple of
#: every dtype's element size)
COPY_PIECE = 4 << 20


class TornRead(RuntimeError):
    """A flash buffer changed (was overwritten, replaced or emptied) while it was
    being read."""


def step_meta(seg: shm.Segment, step: int, where: str) -> tuple[shm.Header, bytes]:
    """``(header, meta block)`` of the flash buffer ``seg`` holding ``step``, read under
    its lock; the meta block checked against the header's crc32. The caller reads the
    data, then checks that ``seg.read_header().seq`` is still ``header.seq``.

    Raises:
        TornRead: the buffer no longer holds a complete save of ``step``.
        CorruptCheckpointError: the meta block's crc32 differs.
    """
    with seg.locked():
        h = seg.read_header()
        if not shm.holds_step(h) or h.step != step:
            raise TornRead(f"{where} no longer holds step {step}")
        meta = seg.meta_bytes(h)
    if zlib.crc32(meta) != h.meta_crc:
        raise CorruptCheckpointError(f"{where}: crc32 of the meta block does not match")
    return h, meta


@functools.cache
def reader_threads() -> int:
    """Threads a load reads in: the cores, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


def read_pool() -> ThreadPoolExecutor:
    """A new pool of :func:`reader_threads` threads, to share between the readers of one
    load (``ShardReader(..., pool=...)``); the caller shuts it down."""
    return ThreadPoolExecutor(reader_threads(), thread_name_prefix="flash-read")


_shared: tuple[int, ThreadPoolExecutor] | None = None
_shared_lock = threading.Lock()


def shared_pool() -> ThreadPoolExecutor:
    """This process's pool of :func:`reader_threads` threads, used by every
    :class:`ShardReader` that is given none and kept for the life of the process (a
    64 MiB load takes a few ms; starting and joining its threads each time would add
    to it). A forked child makes its own."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), read_pool())
        return _shared[1]


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` (a 1-D ``uint8`` tensor of ``dst``'s bytes, e.g. over a shared-memory
    mapping) into ``dst`` (1-D, contiguous) bit for bit, as ``dst``'s dtype where its
    element size divides the bytes: measured on this project's 2-CPU VM, 16 tensors of
    4 MiB copied from a ``/dev/shm`` mapping took 3.6-3.7 ms as ``float32`` (a
    ``Tensor.copy_`` between tensors: 3.7 ms) and 4.1-4.3 ms as ``uint8``. A copy
    between tensors of one dtype converts nothing (NaN payloads included)."""
    import torch

    size = dst.element_size()
    if size > 1 and src.numel() % size == 0:
        try:
            dst.copy_(src.view(dst.dtype))
            return
        except RuntimeError:  # a dtype whose bytes cannot be viewed so
            pass
    dst.view(torch.uint8).copy_(src)


def _copy_piece(dst: torch.Tensor, buf: object, offset: int, nbytes: int) -> None:
    """Copy ``nbytes`` bytes at ``offset`` of the buffer ``buf`` (a mapping) into ``dst``
    as ``dst``'s dtype (:func:`copy_bytes`). The view of ``buf`` exists only during the
    copy, so its mapping can be closed after."""
    import torch

    src = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
    copy_bytes(dst, src)
    del src


def _chunks(address: int, nbytes: int, offset: int) -> list[tuple[int, int, int]]:
    """``(address, nbytes, offset)`` of each ``CHUNK``-byte piece of a read."""
    return [(address + o, min(CHUNK, nbytes - o), offset + o) for o in range(0, nbytes, CHUNK)]


class ShardReader:
    """Reads byte ranges of one open file (a flash buffer or a rank's data file).

    Args:
        path: the file. base: byte offset of the data area in it. pool: the threads to
            read in, shared with the other readers of one load (a reshard reads several
            ranks' buffers at once: one pool keeps it at :func:`reader_threads`
            threads); the caller shuts it down. ``None``: :func:`shared_pool`.
    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str, base: int = 0, pool: ThreadPoolExecutor | None = None) -> None:
        self.path = path
        self.base = base
        self.fd = os.open(path, os.O_RDONLY)
        self._pool: ThreadPoolExecutor | None = pool
        self._pending: list = []
        #: copy_from() pieces not taken yet, and the pool's tasks that take them
        self._copies: collections.deque = collections.deque()
        self._copiers: list = []
        self._queued = 0  # bytes queued since the last drain
        self._cuda_devices: set = set()  # devices with copies still in flight (drain waits)

    def close(self) -> None:
        self._copies.clear()  # not run after an error (drain runs them on success)
        for f in self._copiers:  # a copier may still hold a view of the mapping
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - closing after an error already raised
                pass
        self._copiers = []
        try:
            self.drain()
        except BaseException:  # noqa: BLE001 - closing after an error already raised
            pass
        self._pool = None
        try:
            os.close(self.fd)
        except OSError:
            pass

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_exact(self, address: int, nbytes: int, offset: int) -> None:
        done = 0
        while done < nbytes:
            buf = (ctypes.c_char * (nbytes - done)).from_address(address + done)
            n = os.preadv(self.fd, [buf], self.base + offset + done)
            if n <= 0:
                raise OSError(f"{self.path}: {nbytes - done} bytes missing at offset "
                              f"{self.base + offset + done} (file truncated?)")
            done += n

    def read_into(self, dst: torch.Tensor, offset: int) -> None:
        """Fill ``dst`` with the bytes at data offset ``offset``: a CPU tensor in place;
        a contiguous CUDA tensor through pinned host chunks (:meth:`_read_to_cuda`:
        the copies may still run when this returns; :meth:`drain` waits for them);
        another tensor through a temporary contiguous CPU copy.

        Raises:
            OSError: the file is shorter than the range.
        """
        import torch

        nbytes = dst.numel() * dst.element_size()
        if nbytes == 0:
            return
        if dst.device.type == "cuda" and dst.is_contiguous():
            self._read_to_cuda(dst, offset, nbytes)
            return
        if dst.device.type != "cpu" or not dst.is_contiguous():
            tmp = torch.empty(dst.shape, dtype=dst.dtype)
            self.read_into(tmp, offset)
            dst.copy_(tmp)
            return
        address = dst.data_ptr()
        if nbytes < PARALLEL_MIN or reader_threads() == 1:
            self._read_exact(address, nbytes, offset)
            return
        self._read_parts(_chunks(address, nbytes, offset))

    def _executor(self) -> ThreadPoolExecutor:
        """The reader's threads (the given pool, else :func:`shared_pool`)."""
        if self._pool is None:
            self._pool = shared_pool()
        return self._pool

    def _read_parts(self, parts: list[tuple[int, int, int]]) -> None:
        """:meth:`_read_exact` of each ``(address, nbytes, offset)``, over the reader's
        threads when there are several; returns once all are read."""
        if len(parts) == 1:
            self._read_exact(*parts[0])
            return
        for f in [self._executor().submit(self._read_exact, *p) for p in parts]:
            f.result()

    def _read_to_cuda(self, dst: torch.Tensor, offset: int, nbytes: int) -> None:
        """Read ``CHUNK``-byte pieces into pinned host memory (torch's caching host
        allocator, which reuses a block once the copy from it has ended), a few at a
        time over the reader's threads, and copy each to its place in ``dst`` with
        ``copy_(non_blocking=True)`` on the current stream: a DMA from pinned memory,
        where a copy from pageable memory would first fault in a temporary tensor and
        then copy synchronously."""
        import torch

        flat = dst.view(-1).view(torch.uint8)
        starts = list(range(0, nbytes, CHUNK))
        width = reader_threads()
        for i in range(0, len(starts), width):
            batch = [(o, min(CHUNK, nbytes - o)) for o in starts[i:i + width]]
            hosts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _, n in batch]
            self._read_parts([(h.data_ptr(), n, offset + o)
                              for (o, n), h in zip(batch, hosts)])
            for (o, n), h in zip(batch, hosts):
                flat[o:o + n].copy_(h, non_blocking=True)
        self._cuda_devices.add(dst.device)

    def submit(self, dst: torch.Tensor, offset: int) -> None:
        """:meth:`read_into` in the reader's threads when ``dst`` is large (the call
        returns at once; :meth:`drain` waits), inline when it is small."""
        nbytes = dst.numel() * dst.element_size()
        if (nbytes < INLINE_MAX or reader_threads() == 1 or dst.device.type != "cpu"
                or not dst.is_contiguous()):
            self.read_into(dst, offset)
            return
        self._pending += [self._executor().submit(self._read_exact, *part)
                          for part in _chunks(dst.data_ptr(), nbytes, offset)]

    def copy_from(self, dst: torch.Tensor, buf: object, offset: int) -> None:
        """Copy ``dst``'s bytes from ``buf`` at byte ``offset`` (a populated mapping of
        the file, e.g. ``shm.Segment.mm``; absolute, not from :attr:`base`) into
        ``dst`` (1-D, contiguous, CPU), as ``dst``'s dtype. Queued in pieces of
        :data:`COPY_PIECE` bytes: once :data:`COPY_PARALLEL_MIN` bytes are queued, the
        reader's threads start taking pieces while the caller queues more; :meth:`drain`
        takes the rest in the calling thread too and waits for all."""
        nbytes = dst.numel() * dst.element_size()
        size = dst.element_size()
        for o in range(0, nbytes, COPY_PIECE):
            n = min(COPY_PIECE, nbytes - o)
            self._copies.append((dst[o // size:(o + n) // size], buf, offset + o, n))
        self._queued += nbytes
        if self._queued >= COPY_PARALLEL_MIN:
            self._start_copiers()

    def _start_copiers(self) -> None:
        """Keep ``reader_threads() - 1`` pool tasks taking queued pieces."""
        running = sum(not f.done() for f in self._copiers)
        for _ in range(reader_threads() - 1 - running):
            self._copiers.append(self._executor().submit(self._copy_queued))

    def _copy_queued(self) -> None:
        """Copy queued pieces, one at a time, until none is left (``deque.popleft``
        hands each piece to one thread)."""
        while True:
            try:
                piece = self._copies.popleft()
            except IndexError:
                return
            _copy_piece(*piece)

    def _drain_copies(self) -> None:
        if self._queued >= COPY_PARALLEL_MIN and self._copies:
            self._start_copiers()
        self._queued = 0
        err = None
        try:
            self._copy_queued()
        except BaseException as exc:  # noqa: BLE001 - stop the others, wait, then raise
            self._copies.clear()
            err = exc
        copiers, self._copiers = self._copiers, []
        for f in copiers:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - raise the first
                err = err or exc
        if err is not None:
            raise err

    def drain(self) -> None:
        """Run the copies :meth:`copy_from` queued, wait for the reads :meth:`submit`
        started and the copies to CUDA tensors; raises the first error."""
        err = None
        try:
            self._drain_copies()
        except BaseException as exc:  # noqa: BLE001 - wait for the reads, then raise
            err = exc
        pending, self._pending = self._pending, []
        for f in pending:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 - wait for all, raise the first
                err = err or exc
        devices, self._cuda_devices = self._cuda_devices, set()
        if devices:
            import torch

            for device in devices:  # the host-to-device copies of _read_to_cuda
                torch.cuda.synchronize(device)
        if err is not None:
            raise err

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
        """A new CPU tensor of ``dtype`` and ``shape`` read from data offset ``offset``."""
        import torch

        t = torch.empty(shape, dtype=dtype)
        self.read_into(t, offset)
        return t
