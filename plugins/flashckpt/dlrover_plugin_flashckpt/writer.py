"""The writer of :class:`.saver.FlashSaver` (:class:`SlotWriter`): one save into one
slot of the rank's :class:`.slots.SlotPool`, in the training thread.

It owns the pinned staging buffers (:mod:`.staging`) through which CUDA tensors are
copied when the slot buffers cannot be page-locked; the buffers themselves are the
pool's. A save:

1. picks and claims a slot (:meth:`.slots.SlotPool.pick`: WRITING, sequence number
   raised), or is skipped when every slot is being persisted or waits for it;
2. lays the slot's buffer out again when the state outgrew it (the one slow save);
3. ``tensor.copy_`` every tensor into it (raw bytes; DTensors their local shard; CUDA
   tensors by DMA into the page-locked buffer, or through the staging buffers);
4. writes the meta block, and marks the slot READY with the step, a crc32 of the meta
   block, the data length and the layout signature.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any

from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import layout, shm, staging
from dlrover_plugin_flashckpt.slots import META_MIN, SlotPool

log = logging.getLogger("dlrover_plugin_flashckpt.saver")

declare("flash.save.copied", "state", "save",
        "the state is copied into the WRITING slot; its meta block is not written yet")
declare("flash.save.ready", "state", "save", "the slot is about to be marked READY")


class SlotWriter:
    """Writes one save into a slot of ``pool`` (see the module docstring)."""

    def __init__(self, pool: SlotPool) -> None:
        self.pool = pool
        self._staging = staging.HostStaging()

    def write(self, step: int, table: list[layout.TensorEntry], sources: list[Any],
              meta: bytes, due: bool) -> dict | None:
        """Write ``sources`` (the tensors of ``table``) and ``meta`` into a slot as
        ``step`` (``due``: for persistence). Call with ``pool.lock`` held.

        Returns ``{"slot", "copy_s", "laid_out", "bytes"}`` (``laid_out``: the buffer
        was laid out by this save), or ``None`` when the save was skipped (recorded in
        ``pool.skipped``).
        Raises:
            ShmSpaceError: too little shared memory for a buffer that must grow (the
                slot is given back as it was).
        """
        pool = self.pool
        sig = layout.signature(table)
        data_len = layout.data_size(table)
        picked = pool.pick(step, due)
        if picked is None:
            return None
        slot, before = picked
        seg = pool.segs[slot]
        laid_out = seg is None or not pool.fits(seg, data_len, len(meta))
        if laid_out:
            seg = self._lay_out(slot, seg, before, step, data_len, len(meta))
        assert seg is not None
        t1 = time.perf_counter()
        views = pool.views_for(slot, seg, table, sig)
        if pool.pin(sources):
            # the buffers are page-locked: one DMA per tensor straight into shared
            # memory (50-51 GiB/s on an H100, docs/flash-checkpoint.md)
            for dst, src in zip(views, sources):
                dst.copy_(src, non_blocking=True)
            import torch

            torch.cuda.synchronize()
        else:
            # CPU tensors directly; GPU tensors, when cudaHostRegister refused the
            # buffers, through pinned staging buffers on a side stream
            self._staging.copy(views, sources)
        copy_s = time.perf_counter() - t1
        crashpoint("flash.save.copied")
        seg.write_meta(meta)
        with seg.locked():
            crashpoint("flash.save.ready")
            h = seg.read_header()
            h.step, h.state, h.due = step, shm.READY, int(due)
            h.meta_len, h.meta_crc = len(meta), zlib.crc32(meta)
            h.data_len, h.saved_at = data_len, time.time()
            h.crc_seq, h.sig = 0, sig
            seg.write_header(h)
        pool.newest_saved = step
        return {"slot": slot, "copy_s": copy_s, "laid_out": laid_out, "bytes": data_len}

    def _lay_out(self, slot: int, seg: shm.Segment | None, before: shm.Header | None,
                 step: int, data_len: int, meta_len: int) -> shm.Segment:
        """Lay out the buffer of the claimed ``slot`` for the save (slow: allocation
        and page faults, logged) and claim the new buffer (WRITING)."""
        pool = self.pool
        t_grow = time.perf_counter()
        # room for a little growth, so that a slightly larger state does not pay again
        try:
            new = pool.ensure(slot, data_len + data_len // 8, 2 * meta_len + META_MIN,
                              claimed=seg is not None)
        except BaseException:
            if seg is not None and before is not None:  # nothing was written into it
                pool.unpick(slot, seg, before)
            raise
        if new.read_header().state != shm.WRITING:  # a new buffer: claim it
            with new.locked():
                h = new.read_header()
                h.state, h.seq = shm.WRITING, h.seq + 1
                h.writer_pid, h.writer_start = shm.my_identity()
                new.write_header(h)
        log.warning("flash save of step %d laid out buffer %d itself (%.2f s; %d bytes): "
                    "%s; the others grow in the background. load() before the first "
                    "save, or checkpoint.options.reserve_mib, avoids this", step, slot,
                    time.perf_counter() - t_grow, data_len,
                    "no buffer was reserved" if pool.segs.count(None) + 1 >= len(
                        pool.segs) and not pool.last_reserve else
                    "the state outgrew the reserved buffer")
        return new
