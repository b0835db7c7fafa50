"""Device-to-shared-memory copies through pinned host staging buffers.

A flash save of a GPU-resident state copies each tensor's bytes in chunks: a
non-blocking device-to-host copy of chunk ``i`` into a page-locked (pinned) staging
buffer on a side CUDA stream, then, once its CUDA event completed, a CPU copy of that
buffer into the tensor's place in shared memory. With ``depth`` buffers (2 by default:
double buffering) the DMA of the next chunks runs while the CPU copies the earlier
ones, and the shared-memory buffers themselves need no page-locking
(``cudaHostRegister`` of large ``/dev/shm`` mappings is slow and may be refused).
The side stream first waits for the current stream, so the copies see every kernel
queued before the save.

CPU tensors (and every tensor when CUDA is absent) are copied directly with
``Tensor.copy_``: the fallback path. ``HostStaging(stage_cpu=True)`` sends CPU tensors
through the chunked staging path too (unpinned buffers, no stream), so that its chunk
arithmetic is tested on machines without a GPU.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

#: bytes of one staging buffer (32 MiB)
CHUNK_BYTES = 32 << 20


def _bytes(t: Any) -> Any:
    """A flat ``uint8`` view of a contiguous tensor's storage (``[nbytes]``)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


class HostStaging:
    """Pinned staging buffers, kept between saves (allocated at the first GPU save).

    Args:
        chunk_bytes: bytes per staging buffer (>= 1).
        depth: buffers in flight (>= 1; 2 overlaps a chunk's D2H with the previous
            chunk's copy into shared memory).
        stage_cpu: send CPU sources through the staging path too (tests).

    Raises:
        ValueError: ``chunk_bytes`` or ``depth`` < 1.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, depth: int = 2,
                 stage_cpu: bool = False) -> None:
        if chunk_bytes < 1 or depth < 1:
            raise ValueError(f"HostStaging(chunk_bytes={chunk_bytes}, depth={depth}): both "
                             "must be >= 1")
        self.chunk_bytes, self.depth, self.stage_cpu = int(chunk_bytes), int(depth), stage_cpu
        self.buffers: list[Any] = []
        self._streams: dict[Any, Any] = {}
        #: ``{"staged_bytes", "direct_bytes", "chunks"}`` of the last :meth:`copy`
        self.last: dict[str, int] = {}

    def _ensure_buffers(self, pinned: bool) -> None:
        import torch

        if len(self.buffers) == self.depth and \
                all(b.is_pinned() == pinned for b in self.buffers):
            return
        self.buffers = [torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=pinned)
                        for _ in range(self.depth)]

    def _stream(self, device: Any) -> Any:
        import torch

        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def copy(self, dsts: Sequence[Any], srcs: Sequence[Any]) -> dict[str, int]:
        """Copy each ``srcs[i]`` into ``dsts[i]`` (same dtype and number of elements;
        ``dsts`` contiguous CPU tensors, e.g. views of shared memory); returns when
        every byte is in ``dsts``.

        Returns:
            ``{"staged_bytes", "direct_bytes", "chunks"}``: bytes that went through the
            staging buffers, bytes copied directly, staging chunks.
        """
        staged = [(d, s) for d, s in zip(dsts, srcs)
                  if getattr(s, "is_cuda", False) or self.stage_cpu]
        direct = [(d, s) for d, s in zip(dsts, srcs)
                  if not (getattr(s, "is_cuda", False) or self.stage_cpu)]
        for d, s in direct:
            d.copy_(s)
        chunks = self._staged(staged) if staged else 0
        self.last = {"staged_bytes": sum(d.numel() * d.element_size() for d, _ in staged),
                     "direct_bytes": sum(d.numel() * d.element_size() for d, _ in direct),
                     "chunks": chunks}
        return self.last

    def _staged(self, pairs: list[tuple[Any, Any]]) -> int:
        import torch

        cuda = any(getattr(s, "is_cuda", False) for _, s in pairs)
        self._ensure_buffers(pinned=cuda)
        # (buffer index, destination byte slice, bytes, CUDA event or None, source ref)
        pending: deque = deque()
        busy = [False] * self.depth
        chunks = 0

        def drain_one() -> None:
            k, dst, n, event, _ = pending.popleft()
            if event is not None:
                event.synchronize()
            dst.copy_(self.buffers[k][:n])
            busy[k] = False

        k = 0
        for d, s in pairs:
            src = _bytes(s.detach().contiguous())
            dst = _bytes(d)
            stream = None
            if src.is_cuda:
                stream = self._stream(src.device)
                stream.wait_stream(torch.cuda.current_stream(src.device))
            for off in range(0, src.numel(), self.chunk_bytes):
                n = min(self.chunk_bytes, src.numel() - off)
                if busy[k]:
                    while busy[k]:
                        drain_one()
                event = None
                if stream is not None:
                    with torch.cuda.stream(stream):
                        self.buffers[k][:n].copy_(src[off:off + n], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    self.buffers[k][:n].copy_(src[off:off + n])
                busy[k] = True
                pending.append((k, dst[off:off + n], n, event, src))
                chunks += 1
                k = (k + 1) % self.depth
        while pending:
            drain_one()
        return chunks

    def close(self) -> None:
        """Free the staging buffers (the next GPU save allocates them again)."""
        self.buffers = []
        self._streams.clear()
