"""The slot pool of one rank of :class:`.saver.FlashSaver` (:class:`SlotPool`).

It owns this rank's ``options.slots`` shared-memory buffers (:mod:`.shm`): their
paths, their mappings, the tensor views into them, their page locks for CUDA copies,
the lock a save holds while it writes (and the background thread while it swaps a
buffer in), the background thread (``flash-reserve``) that lays the buffers out
(sized from ``options.reserve_mib`` or from the state a load restores into,
:mod:`.capacity`) and grows those a save outgrew, and the record of skipped saves.

Threads: the training thread picks and claims a slot (:meth:`SlotPool.pick`) and, for
a buffer too small, lays it out itself (:meth:`SlotPool.ensure`); the
``flash-reserve`` thread runs :meth:`SlotPool.reserve` and the saver's search for
its persister (:meth:`SlotPool.background`). The node's persister reads and claims
the same buffers from its own process, under each buffer's header lock.

A save picks an empty slot, else the one with the oldest step that is neither being
persisted nor waiting to be; a step that is due for persistence may also replace a
newer-step slot still waiting (it supersedes it). When every slot is being persisted
or waiting, the save is skipped and logged (it never waits for a disk write).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import capacity, layout, premap, shm

log = logging.getLogger("dlrover_plugin_flashckpt.saver")

declare("flash.save.slot_writing", "state", "save",
        "a save marks its slot WRITING (the step the slot held is given up)")

#: smallest meta block capacity of a buffer (bytes)
META_MIN = 64 << 10


class _Superseded(Exception):
    """A background replacement of a buffer is no longer wanted."""


class SlotPool:
    """This rank's buffers (see the module docstring).

    Args:
        opts: the saver's :class:`.options.FlashOptions` (``slots``, ``shm_dir``,
            ``wait_timeout_s``).
        paths: the buffers' paths, one per slot.
        rank, world_size, directory, role: whose buffers they are (a buffer of
            another rank, world size or directory is never reused).
        ident: the identity written into a new buffer (called at each layout).
    """

    def __init__(self, opts: Any, paths: list[str], rank: int, world_size: int,
                 directory: str, role: str, ident: Callable[[], dict]) -> None:
        self.opts = opts
        self.paths = list(paths)
        self.rank, self.world_size, self.dir, self.role = rank, world_size, directory, role
        self._ident = ident
        #: slot -> its mapping (``None``: not mapped yet)
        self.segs: list[shm.Segment | None] = [None] * len(self.paths)
        #: slot -> (layout signature, segment, tensor views into it)
        self._views: dict[int, tuple[bytes, shm.Segment, list[Any]]] = {}
        self._pinned: list[Any] = []
        self._pinned_segs: list[int] = []
        #: one background thread: finds the persister, lays out the buffers
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-reserve")
        self._reserving: Future | None = None
        #: whether the running reservation is a growth (a save does not wait for it)
        self.growing = False
        self._closing = threading.Event()
        #: held by a save, and by the background thread while it swaps a buffer in
        self.lock = threading.RLock()
        #: ``{"data_bytes", "meta_bytes", "seconds"}`` of the last finished reservation
        self.last_reserve: dict = {}
        #: ``(step, reason)`` of skipped saves
        self.skipped: list[tuple[int, str]] = []
        #: the newest step saved into the pool (a growth may replace older ones)
        self.newest_saved: int | None = None

    def background(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` in the pool's background thread (after any reservation)."""
        return self._bg.submit(fn, *args)

    def reserving(self) -> bool:
        """Whether a reservation is still running."""
        fut = self._reserving
        return fut is not None and not fut.done()

    def close(self, hand_over: bool = False) -> None:
        """Wait for the background thread and unmap the buffers (they stay in
        ``shm_dir`` for a restart). ``hand_over``: keep the mappings whose page tables
        are filled for this process's next pool of the same slots instead
        (:func:`.premap.hand_over`: a re-setup in place)."""
        self._closing.set()
        self.wait_reserved()
        self._bg.shutdown(wait=True)
        self._unpin()
        self._views.clear()
        kept = []
        for i, seg in enumerate(self.segs):
            if seg is not None:
                if hand_over and seg.populated and not seg.replaced():
                    kept.append(seg)
                else:
                    seg.close()
            self.segs[i] = None
        if kept:
            premap.hand_over(kept)

    def wait_reserved(self) -> None:
        """Wait for a background reservation (at most one runs; every method that
        touches the buffers calls this first)."""
        fut, self._reserving = self._reserving, None
        if fut is None:
            return
        try:
            fut.result()
        except Exception as exc:  # noqa: BLE001 - the next save lays the buffer out itself
            log.warning("laying out the flash buffers in the background failed (%s); the "
                        "next save lays them out", exc)

    def reserve(self, data_bytes: int, meta_bytes: int = META_MIN,
                wait: bool = False, grow: bool = False) -> Future:
        """Lay out this rank's ``options.slots`` buffers for saves of up to
        ``data_bytes`` tensor bytes and ``meta_bytes`` of meta block, in a background
        thread (allocation and page faults off the training step's critical path).
        Buffers that already fit are kept (mapped again with their page tables filled,
        as after a restart); a buffer holding a step that a load may still want is
        left alone (a save that takes it grows it). A save waits for a reservation
        still running, except a growth (``grow``: after a save outgrew its buffer), which
        waits for each other buffer to be free (persisted, superseded) and swaps it in
        between saves.

        Returns the reservation's future (``wait=True``: done when this returns).
        Raises:
            ValueError: a negative size.
        """
        if data_bytes < 0 or meta_bytes < 0:
            raise ValueError(f"reserve({data_bytes}, {meta_bytes}): sizes are bytes >= 0")
        self.wait_reserved()
        if not grow and self._all_in_place(int(data_bytes), int(meta_bytes)):
            # what _reserve_all would find (a survivor's load in place): no thread woken
            self.last_reserve = {"data_bytes": int(data_bytes), "meta_bytes": int(meta_bytes),
                                 "seconds": 0.0}
            done: Future = Future()
            done.set_result(None)
            self.growing = False
            return done
        fut = self._bg.submit(self._reserve_all, int(data_bytes), int(meta_bytes), grow)
        self._reserving, self.growing = fut, grow
        if wait:
            self.wait_reserved()
        return fut

    def reserve_for(self, state_dict: dict, wait: bool = False,
                    known: tuple[int, int] | None = None) -> Future:
        """:meth:`reserve` for saves of ``state_dict``, including the optimizer state a
        fresh optimizer creates at its first step (:func:`capacity.estimate`; ``known``:
        its sizes from a load that restored exactly this layout, as there)."""
        data, meta = capacity.estimate(state_dict, known)
        return self.reserve(data, max(META_MIN, 2 * meta), wait)

    def _all_in_place(self, data: int, meta: int) -> bool:
        """Whether every slot is mapped with its page tables filled and fits ``data`` +
        ``meta`` bytes (:meth:`ensure` would keep each as it is)."""
        with self.lock:
            for i in range(self.opts.slots):
                seg = self.segs[i]
                if seg is None or not seg.populated or seg.replaced() \
                        or not self.fits(seg, data, meta):
                    return False
        return True

    def _reserve_all(self, data: int, meta: int, grow: bool = False) -> None:
        t0 = time.perf_counter()
        for i in range(self.opts.slots):
            if grow:  # wait (off the critical path) until the slot may be replaced
                deadline = time.monotonic() + self.opts.wait_timeout_s
                while not self._closing.is_set() and time.monotonic() < deadline:
                    with self.lock:
                        seg = self.attach(i)
                        if seg is None or self.fits(seg, data, meta) or self._replaceable(seg):
                            break
                    time.sleep(0.05)
            self.ensure(i, data, meta, claimed=False)
        self.last_reserve = {"data_bytes": data, "meta_bytes": meta,
                             "seconds": time.perf_counter() - t0}

    def attach(self, i: int) -> shm.Segment | None:
        seg = self.segs[i]
        if seg is not None and seg.replaced():
            seg.close()
            seg = self.segs[i] = None
        if seg is None:   # a promoted standby's premapped one first (.premap)
            seg = self.segs[i] = premap.take(self.paths[i]) or shm.Segment.attach(self.paths[i])
        return seg

    def fits(self, seg: shm.Segment, data: int, meta: int) -> bool:
        h = seg.read_header()
        return (seg.data_cap >= data and h.meta_cap >= meta and h.rank == self.rank
                and h.world_size == self.world_size and seg.ident().get("dir") == self.dir)

    def _replaceable(self, seg: shm.Segment) -> bool:
        """Whether a background reservation may replace ``seg``: it holds no step, or
        one this process has superseded with a newer save and that is neither being
        persisted nor waiting for it."""
        h = seg.read_header()
        if not shm.holds_step(h):
            return True
        if self.newest_saved is None or h.step >= self.newest_saved:
            return False
        st = shm.effective_state(h)
        return st == shm.READY and not (h.due and h.persisted_seq != h.seq)

    def ensure(self, i: int, data: int, meta: int, claimed: bool) -> shm.Segment:
        """The mapped buffer of slot ``i``, with room for ``data`` + ``meta`` bytes:
        the existing one when it fits, else a new one replacing it (``claimed``: the
        caller holds the slot in WRITING, so it is replaced whatever it held).

        Raises:
            ShmSpaceError: too little shared memory (says how much).
        """
        with self.lock:
            seg = self.attach(i)
            if seg is not None and self.fits(seg, data, meta):
                if not seg.populated:  # a buffer of an earlier process of this rank
                    again = shm.Segment.attach(self.paths[i], populate=True)
                    if again is not None and again.inode == seg.inode:
                        shm.prefault_write(again.mm, shm.HEADER_SIZE,
                                           again.size - shm.HEADER_SIZE)
                        seg.close()
                        seg = self.segs[i] = again
                        self._views.pop(i, None)
                    elif again is not None:
                        again.close()
                return seg
            if seg is not None and not claimed and not self._replaceable(seg):
                return seg
        data_cap = shm.round_up(max(data, 1))
        meta_cap = shm.round_up(max(META_MIN, meta))
        size = shm.HEADER_SIZE + meta_cap + data_cap
        shm.check_space(self.opts.shm_dir, size,
                        f"buffer {i} of {self.role or 'rank'} rank {self.rank} "
                        f"({data} bytes of tensors)")
        # the slow part (allocation, page faults) runs without the lock: a save may go on
        new = shm.Segment.create(self.paths[i], meta_cap, data_cap, self._ident(), bytes(16),
                                 self.rank, self.world_size, install=False)
        try:
            with self.lock:
                seg = self.attach(i)
                if seg is not None and not claimed and (
                        self.fits(seg, data, meta) or not self._replaceable(seg)):
                    raise _Superseded  # a save grew it meanwhile, or took it
                if seg is not None:
                    with seg.locked():
                        old = seg.read_header()
                        h = new.read_header()
                        h.seq = old.seq
                        if claimed:
                            h.state, h.writer_pid, h.writer_start = (
                                shm.WRITING, old.writer_pid, old.writer_start)
                        new.write_header(h)
                        new.install()
                    seg.close()
                else:
                    new.install()
                self.segs[i] = new
                self._views.pop(i, None)
                return new
        except BaseException as exc:
            new.close()
            try:
                os.unlink(new.path)
            except OSError:
                pass
            if isinstance(exc, _Superseded):
                return self.segs[i]  # type: ignore[return-value]
            raise

    def views_for(self, i: int, seg: shm.Segment, table: list[layout.TensorEntry],
                   sig: bytes) -> list[Any]:
        cached = self._views.get(i)
        if cached is not None and cached[0] == sig and cached[1] is seg:
            return cached[2]
        h = seg.read_header()
        views = [layout.tensor_view(seg.mm, h.data_offset, e) for e in table]
        self._views[i] = (sig, seg, views)
        return views

    def pin(self, sources: list[Any]) -> bool:
        """Page-lock the buffers for CUDA when the state is on a GPU, so the
        device-to-host copies are DMA transfers. Returns whether they are pinned."""
        if not any(getattr(t, "is_cuda", False) for t in sources):
            return False
        segs = [s for s in self.segs if s is not None]
        if self._pinned and self._pinned_segs != [id(s) for s in segs]:
            self._unpin()  # a buffer was replaced
        if not self._pinned:
            try:
                self._pinned = shm.pin_buffers(segs)
                self._pinned_segs = [id(s) for s in segs]
            except Exception as exc:  # noqa: BLE001 - pageable copies still work
                log.warning("could not pin the flash buffers for CUDA copies (%s); copies are "
                            "synchronous", exc)
                return False
        return True

    def unpick(self, i: int, seg: shm.Segment, before: shm.Header) -> None:
        """Give back slot ``i`` that :meth:`pick` claimed, as it was, when the save
        failed before writing into it (a new buffer that could not be allocated:
        ``ShmSpaceError``): the step it held stays loadable. Left alone when the slot
        is no longer the buffer claimed or another claim followed."""
        if self.segs[i] is not seg or seg.replaced():
            return
        with seg.locked():
            h = seg.read_header()
            if h.state == shm.WRITING and h.seq == before.seq + 1 \
                    and (h.writer_pid, h.writer_start) == shm.my_identity():
                seg.write_header(before)

    def _unpin(self) -> None:
        if self._pinned:
            shm.unpin_buffers(self._pinned)
        self._pinned_segs = []

    def pick(self, step: int, due: bool) -> tuple[int, shm.Header | None] | None:
        """Claim the slot the save of ``step`` writes into (WRITING, the sequence number
        raised): ``(slot, the header it had before)`` (``None``: not laid out yet), or
        ``None`` when the save is skipped (logged, in :attr:`skipped`)."""
        free, done, waiting = [], [], []
        states = []
        for i in range(self.opts.slots):
            seg = self.segs[i]
            if seg is None:
                free.append((-2, i))
                continue
            h = seg.read_header()
            st = shm.effective_state(h)
            states.append(f"slot {i}: {shm.STATE_NAMES[st]} step {h.step}")
            if st in (shm.EMPTY, shm.WRITING):
                free.append((h.step, i))
            elif st == shm.READY:
                (waiting if h.due and h.persisted_seq != h.seq else done).append((h.step, i))
        order = [i for _, i in sorted(free)] + [i for _, i in sorted(done)]
        if due:
            order += [i for _, i in sorted(waiting)]
        for i in order:
            seg = self.segs[i]
            if seg is None:
                return i, None
            with seg.locked():
                h = seg.read_header()
                before = dataclasses.replace(h)
                if shm.effective_state(h) == shm.PERSISTING:
                    continue
                if h.state == shm.READY and h.due and h.persisted_seq != h.seq:
                    if not due:
                        continue
                    log.info("flash save of step %d replaces step %d before it was persisted",
                             step, h.step)
                h.state = shm.WRITING
                h.seq += 1
                h.writer_pid, h.writer_start = shm.my_identity()
                crashpoint("flash.save.slot_writing")
                seg.write_header(h)
                return i, before
        reason = ("every buffer is being persisted or holds a step waiting for it ("
                  + "; ".join(states) + "); raise checkpoint.options.persist_every_steps or "
                  "slots, or save less often")
        self.skipped.append((step, reason))
        log.warning("flash save of step %d skipped: %s", step, reason)
        return None
