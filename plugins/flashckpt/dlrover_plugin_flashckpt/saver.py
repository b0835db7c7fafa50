"""``FlashSaver``: the ``flash`` checkpoint saver, in the training process.

Save (blocking only for the copy):

0. before the first save, a background thread finds the node's persister and lays
   out ``options.slots`` shared-memory buffers for this rank (:mod:`.shm`), allocated
   and page-faulted, sized from ``options.reserve_mib`` or from the state that
   :meth:`FlashSaver.load` restores into (:mod:`.capacity`); a buffer is reused for
   every save that fits in it, whatever its tensor table;
1. split the state dict into the tensor table, the tensors and the skeleton
   (:mod:`.layout`); a state that outgrew its buffer lays that one out again (the one
   slow save) and the others grow in the background;
2. pick a slot: an empty one, else the one with the oldest step that is neither
   being persisted nor waiting to be; a step that is due for persistence may also
   replace a newer-step slot still waiting (it supersedes it). When every slot is
   being persisted or waiting, the save is **skipped** and logged: it never waits,
   because waiting would stall training for a disk write (the issue's "blocks only for
   the copy"), and the step it would have replaced is on its way to disk;
3. mark the slot WRITING, ``tensor.copy_`` every tensor into it (raw bytes; DTensors
   their local shard; CUDA tensors by DMA into the pinned buffer), write the pickled
   meta block, mark it READY with the step, a crc32 of the meta block and the writer;
4. notify the node's persister (one non-blocking actor call) and return.

Persist, breakpoint save and the commit run in the persister (:mod:`.persister`).

Load: every rank lists the complete saves it can read from memory: its own slots,
with ``replicas: 1`` the replicas of its rank on any node (:mod:`.replica`), and the
buffers of every rank of another world size on this node (:mod:`.reshard`). When all
ranks hold a common step that is not older than the newest committed step on disk,
each rank reads it into the live state in place, ``pread`` straight into the live
tensors (:mod:`.reader`; checks: state, step, crc32 of the meta block, the tensor
table against the live tensors, the slot's sequence number before and after the
copy; with ``verify_memory: data`` also the crc32 of the data). Otherwise, or when
any rank fails, the newest committed step whose files match the manifest is loaded
(resharded when its world size differs); a corrupt step is skipped with a warning.
After a load, the buffers are reserved in the background for the loaded state.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_core.checkpoint.saver import Saver, SaverConfig, SaverContext, committed_steps, \
    step_dir_name
from dlrover_core.spec.errors import SpecError
from dlrover_plugin_flashckpt import capacity, layout, shm, storage
from dlrover_plugin_flashckpt.options import FlashOptions
from dlrover_plugin_flashckpt.reader import ShardReader

log = logging.getLogger(__name__)

META_MIN = 64 << 10


class _TornRead(RuntimeError):
    """A slot changed while it was being read."""


_SLOT_RE = re.compile(r"-r\d{5}-s\d+$")


class _Superseded(Exception):
    """A background replacement of a buffer is no longer wanted."""


class FlashSaver(Saver):
    """The ``flash`` saver (see the module docstring).

    Args:
        config: ``dir`` (the role's checkpoint directory, shared by every node),
            ``keep`` (committed steps kept, >= 1), ``job`` (names the buffers),
            ``options`` (:class:`FlashOptions`).
        context: rank, world size, and whether a torch.distributed group is up (used
            to agree on the step at load).
    Raises:
        SpecError: a bad option or ``keep``, or ``options.shm_dir`` is not a directory.
    """

    def __init__(self, config: SaverConfig, context: SaverContext) -> None:
        super().__init__(config, context)
        self.opts = FlashOptions.parse(config.options)
        if not isinstance(config.keep, int) or config.keep < 1:
            raise SpecError("checkpoint.keep", config.keep, "an integer >= 1",
                            "the flash saver keeps at least the newest committed step")
        if not os.path.isdir(self.opts.shm_dir):
            raise SpecError("checkpoint.options.shm_dir", self.opts.shm_dir,
                            "an existing tmpfs directory such as /dev/shm", "no such directory")
        self.job = config.job or "job"
        self.dir = os.path.abspath(config.dir)
        self.rank, self.world_size = context.rank, context.world_size
        self.paths = [os.path.join(self.opts.shm_dir,
                                   shm.slot_name(self.job, self.dir, self.rank, s))
                      for s in range(self.opts.slots)]
        self._segs: list[shm.Segment | None] = [None] * self.opts.slots
        #: slot -> (layout signature, segment, tensor views into it)
        self._views: dict[int, tuple[bytes, shm.Segment, list[Any]]] = {}
        self._pinned: list[Any] = []
        self._pinned_segs: list[int] = []
        self._data_len = 0
        self._persister: Any = None
        #: one background thread: finds the persister, lays out the buffers
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flash-reserve")
        self._reserving: Future | None = None
        self._growing = False
        self._closing = threading.Event()
        #: held by a save, and by the background thread while it swaps a buffer in
        self._lock = threading.RLock()
        self._persister_future: Future | None = None
        #: ``{"data_bytes", "meta_bytes", "seconds"}`` of the last finished reservation
        self.last_reserve: dict = {}
        self._notified: Any = None
        self._run_id: str | None = None
        self._newest_saved: int | None = None
        #: where the last :meth:`load` came from: ``memory``, ``disk`` or ``None``
        self.last_load_source: str | None = None
        #: ``{"step", "slot", "copy_s", "total_s", "bytes"}`` of the last save
        self.last_save: dict = {}
        #: ``(step, reason)`` of skipped saves
        self.skipped: list[tuple[int, str]] = []
        try:
            import ray

            if ray.is_initialized():  # found (or started) while the trainer sets up
                self._persister_future = self._bg.submit(self._find_persister)
        except ImportError:
            pass
        if self.opts.reserve_mib:
            self.reserve(int(self.opts.reserve_mib * 2**20))

    # ================================================================== helpers
    def _dist(self) -> Any:
        if not self.context.distributed:
            return None
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None

    def _gather(self, obj: Any) -> list[Any]:
        dist = self._dist()
        if dist is None:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def _ident(self) -> dict:
        from dlrover_plugin_flashckpt import hygiene

        if self._run_id is None:
            self._run_id = self.config.run_id or hygiene.master_run_id(self.job) or ""
        return {"job": self.job, "role": self.context.role, "rank": self.rank,
                "world_size": self.world_size, "dir": self.dir,
                "session": hygiene.current_session(), "run_id": self._run_id}

    def _registration(self) -> dict:
        return {"role": self.context.role, "rank": self.rank, "world_size": self.world_size,
                "dir": self.dir, "keep": self.config.keep, "slots": list(self.paths),
                "persist_every_steps": self.opts.persist_every_steps,
                "throttle_mib_s": self.opts.throttle_mib_s, "run_id": self._run_id or "",
                "shm_dir": self.opts.shm_dir, "replicas": self.opts.replicas}

    def persister(self) -> Any:
        """The node's persister actor handle (found or created, and ready).

        Raises:
            RuntimeError: this process is not connected to Ray.
        """
        import ray

        if self._notified is not None:  # the last notification tells if it is alive
            ready, _ = ray.wait([self._notified], timeout=0)
            if ready:
                self._notified = None
                try:
                    ray.get(ready[0])
                except ray.exceptions.RayActorError:
                    log.warning("the flash persister of this node died; starting a new one")
                    self._persister = None
        if self._persister is None and self._persister_future is not None:
            fut, self._persister_future = self._persister_future, None
            try:
                self._persister = fut.result()
            except Exception as exc:  # noqa: BLE001 - tried again below, errors raised
                log.warning("finding the flash persister in the background failed: %s", exc)
        if self._persister is None:
            if not ray.is_initialized():
                raise RuntimeError("the flash saver needs Ray for its per-node persister: run "
                                   "it inside a dlrover job, or call ray.init() first")
            self._persister = self._find_persister()
        return self._persister

    def _find_persister(self) -> Any:
        from dlrover_plugin_flashckpt.persister import get_persister

        import ray

        self._ident()  # the run id, looked up once
        handle = get_persister(self.job)
        # register now: the first call to an actor opens the connection to it, tens of
        # ms that the first save would otherwise pay
        ray.get(handle.saved.remote(self._registration()), timeout=60)
        return handle

    # ================================================================== buffers
    def _wait_reserve(self) -> None:
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

    def wait_reserved(self) -> None:
        """Block until the background layout of the buffers (if any) is done."""
        self._wait_reserve()

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
        self._wait_reserve()
        fut = self._bg.submit(self._reserve_all, int(data_bytes), int(meta_bytes), grow)
        self._reserving, self._growing = fut, grow
        if wait:
            self._wait_reserve()
        return fut

    def reserve_for(self, state_dict: dict, wait: bool = False) -> Future:
        """:meth:`reserve` for saves of ``state_dict``, including the optimizer state a
        fresh optimizer creates at its first step (:func:`capacity.estimate`)."""
        data, meta = capacity.estimate(state_dict)
        return self.reserve(data, max(META_MIN, 2 * meta), wait)

    def _reserve_all(self, data: int, meta: int, grow: bool = False) -> None:
        t0 = time.perf_counter()
        for i in range(self.opts.slots):
            if grow:  # wait (off the critical path) until the slot may be replaced
                deadline = time.monotonic() + self.opts.wait_timeout_s
                while not self._closing.is_set() and time.monotonic() < deadline:
                    with self._lock:
                        seg = self._attach(i)
                        if seg is None or self._fits(seg, data, meta) or self._replaceable(seg):
                            break
                    time.sleep(0.05)
            self._ensure_slot(i, data, meta, claimed=False)
        self.last_reserve = {"data_bytes": data, "meta_bytes": meta,
                             "seconds": time.perf_counter() - t0}

    def _release_slots(self) -> None:
        self._unpin()
        self._views.clear()
        for i, seg in enumerate(self._segs):
            if seg is not None:
                seg.close()
            self._segs[i] = None

    def _attach(self, i: int) -> shm.Segment | None:
        seg = self._segs[i]
        if seg is not None and seg.replaced():
            seg.close()
            seg = self._segs[i] = None
        if seg is None:
            seg = self._segs[i] = shm.Segment.attach(self.paths[i])
        return seg

    def _fits(self, seg: shm.Segment, data: int, meta: int) -> bool:
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
        if self._newest_saved is None or h.step >= self._newest_saved:
            return False
        st = shm.effective_state(h)
        return st == shm.READY and not (h.due and h.persisted_seq != h.seq)

    def _ensure_slot(self, i: int, data: int, meta: int, claimed: bool) -> shm.Segment:
        """The mapped buffer of slot ``i``, with room for ``data`` + ``meta`` bytes:
        the existing one when it fits, else a new one replacing it (``claimed``: the
        caller holds the slot in WRITING, so it is replaced whatever it held).

        Raises:
            ShmSpaceError: too little shared memory (says how much).
        """
        with self._lock:
            seg = self._attach(i)
            if seg is not None and self._fits(seg, data, meta):
                if not seg.populated:  # a buffer of an earlier process of this rank
                    again = shm.Segment.attach(self.paths[i], populate=True)
                    if again is not None and again.inode == seg.inode:
                        shm.prefault_write(again.mm, shm.HEADER_SIZE,
                                           again.size - shm.HEADER_SIZE)
                        seg.close()
                        seg = self._segs[i] = again
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
                        f"buffer {i} of {self.context.role or 'rank'} rank {self.rank} "
                        f"({data} bytes of tensors)")
        # the slow part (allocation, page faults) runs without the lock: a save may go on
        new = shm.Segment.create(self.paths[i], meta_cap, data_cap, self._ident(), bytes(16),
                                 self.rank, self.world_size, install=False)
        try:
            with self._lock:
                seg = self._attach(i)
                if seg is not None and not claimed and (
                        self._fits(seg, data, meta) or not self._replaceable(seg)):
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
                self._segs[i] = new
                self._views.pop(i, None)
                return new
        except BaseException as exc:
            new.close()
            try:
                os.unlink(new.path)
            except OSError:
                pass
            if isinstance(exc, _Superseded):
                return self._segs[i]  # type: ignore[return-value]
            raise

    def _views_for(self, i: int, seg: shm.Segment, table: list[layout.TensorEntry],
                   sig: bytes) -> list[Any]:
        cached = self._views.get(i)
        if cached is not None and cached[0] == sig and cached[1] is seg:
            return cached[2]
        h = seg.read_header()
        views = [layout.tensor_view(seg.mm, h.data_offset, e) for e in table]
        self._views[i] = (sig, seg, views)
        return views

    def _pin(self, sources: list[Any]) -> bool:
        """Page-lock the buffers for CUDA when the state is on a GPU, so the
        device-to-host copies are DMA transfers. Returns whether they are pinned."""
        if not any(getattr(t, "is_cuda", False) for t in sources):
            return False
        segs = [s for s in self._segs if s is not None]
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

    def _unpin(self) -> None:
        if self._pinned:
            shm.unpin_buffers(self._pinned)
        self._pinned_segs = []

    # ================================================================== save
    def _pick_slot(self, step: int, due: bool) -> int | None:
        free, done, waiting = [], [], []
        states = []
        for i in range(self.opts.slots):
            seg = self._segs[i]
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
            seg = self._segs[i]
            if seg is None:
                return i
            with seg.locked():
                h = seg.read_header()
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
                seg.write_header(h)
                return i
        reason = ("every buffer is being persisted or holds a step waiting for it ("
                  + "; ".join(states) + "); raise checkpoint.options.persist_every_steps or "
                  "slots, or save less often")
        self.skipped.append((step, reason))
        log.warning("flash save of step %d skipped: %s", step, reason)
        return None

    def save(self, step: int, state_dict: dict) -> None:
        """Copy ``state_dict`` into this rank's shared memory as ``step`` and return;
        the node's persister writes it to :attr:`dir` when it is due.

        The buffers are normally laid out before (``reserve_mib``, or :meth:`load`
        reserves them for its state in the background). A save whose buffer is missing
        or too small lays that one out itself (slow: allocation and page faults, logged)
        and the other buffers grow in the background.

        Args:
            step: the training step (>= 0). state_dict: nested dicts/lists/tuples of
                dense tensors (any dtype of ``layout``; DTensors save their local
                shard; CPU or CUDA) and small picklable values.
        Raises:
            ValueError: a negative step. TypeError: an unsupported tensor.
            ShmSpaceError: ``options.shm_dir`` has too little space (says how much).
        """
        try:
            ok = operator.index(step) >= 0
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"step {step!r} is invalid: use an integer >= 0")
        step = operator.index(step)
        t0 = time.perf_counter()
        if not self._growing:  # the first layout: wait for it rather than do it twice
            self._wait_reserve()
        with self._lock:
            self._save(step, state_dict, t0)

    def _save(self, step: int, state_dict: dict, t0: float) -> None:
        table, sources, skeleton = layout.build_table(state_dict)
        sig = layout.signature(table)
        meta = layout.pack_meta(step, table, skeleton,
                                {"rank": self.rank, "world_size": self.world_size})
        data_len = layout.data_size(table)
        persister = self.persister()
        due = self.opts.is_due(step)
        slot = self._pick_slot(step, due)
        if slot is None:
            return
        seg = self._segs[slot]
        laid_out = seg is None or not self._fits(seg, data_len, len(meta))
        if laid_out:
            t_grow = time.perf_counter()
            # room for a little growth, so that a slightly larger state does not pay again
            seg = self._ensure_slot(slot, data_len + data_len // 8, 2 * len(meta) + META_MIN,
                                    claimed=seg is not None)
            if seg.read_header().state != shm.WRITING:  # a new buffer: claim it
                with seg.locked():
                    h = seg.read_header()
                    h.state, h.seq = shm.WRITING, h.seq + 1
                    h.writer_pid, h.writer_start = shm.my_identity()
                    seg.write_header(h)
            log.warning("flash save of step %d laid out buffer %d itself (%.2f s; %d bytes): "
                        "%s; the others grow in the background. load() before the first "
                        "save, or checkpoint.options.reserve_mib, avoids this", step, slot,
                        time.perf_counter() - t_grow, data_len,
                        "no buffer was reserved" if self._segs.count(None) + 1 >= len(
                            self._segs) and not self.last_reserve else
                        "the state outgrew the reserved buffer")
        assert seg is not None
        t1 = time.perf_counter()
        views = self._views_for(slot, seg, table, sig)
        pinned = self._pin(sources)
        for dst, src in zip(views, sources):
            dst.copy_(src, non_blocking=pinned)
        if pinned:
            import torch

            torch.cuda.synchronize()
        copy_s = time.perf_counter() - t1
        seg.write_meta(meta)
        with seg.locked():
            h = seg.read_header()
            h.step, h.state, h.due = step, shm.READY, int(due)
            h.meta_len, h.meta_crc = len(meta), zlib.crc32(meta)
            h.data_len, h.saved_at = data_len, time.time()
            h.crc_seq, h.sig = 0, sig
            seg.write_header(h)
        self._newest_saved = step
        self._data_len = data_len
        self._notified = persister.saved.remote(self._registration(), step)
        self.last_save = {"step": step, "slot": slot, "copy_s": copy_s, "laid_out": laid_out,
                          "total_s": time.perf_counter() - t0, "bytes": data_len}
        if laid_out and self.opts.slots > 1:
            fut = self._reserving
            if fut is not None and not fut.done():  # an older growth: let it finish
                return
            self.reserve(data_len + data_len // 8, 2 * len(meta) + META_MIN, grow=True)

    # ================================================================== load
    def _memory_steps(self) -> dict[int, int]:
        """step -> slot of the complete saves this rank's buffers hold."""
        out: dict[int, tuple[int, int]] = {}
        for i in range(self.opts.slots):
            seg = self._attach(i)
            if seg is None:
                continue
            h = seg.read_header()
            ident = seg.ident()
            if not shm.holds_step(h) or ident.get("dir") != self.dir \
                    or h.world_size != self.world_size or h.rank != self.rank:
                continue
            if h.step not in out or out[h.step][1] < h.seq:
                out[h.step] = (i, h.seq)
        return {s: i for s, (i, _) in out.items()}

    def _load_memory(self, state_dict: dict, step: int, slot: int) -> None:
        # the header and meta block through the mapping (a few pages); the data with
        # pread straight into the live tensors (reader.py): no page tables to fill
        seg = self._attach(slot)
        if seg is None:
            raise _TornRead(f"flash buffer {self.paths[slot]} disappeared")
        where = f"flash buffer {seg.name} (step {step})"
        with seg.locked():
            h = seg.read_header()
            if not shm.holds_step(h) or h.step != step:
                raise _TornRead(f"{where} no longer holds step {step}")
            meta = seg.meta_bytes(h)
        if zlib.crc32(meta) != h.meta_crc:
            raise CorruptCheckpointError(f"{where}: crc32 of the meta block does not match")
        m = layout.unpack_meta(meta)
        if m.get("rank") != self.rank or m.get("step") != step:
            raise CorruptCheckpointError(f"{where}: holds rank {m.get('rank')} step "
                                         f"{m.get('step')}")
        if self.opts.verify_memory == "data":
            if h.crc_seq == h.seq:
                with seg.data_view(h) as data:
                    if zlib.crc32(data) != h.data_crc:
                        raise CorruptCheckpointError(f"{where}: crc32 of the data does not "
                                                     "match the one recorded when persisted")
            else:
                log.info("%s: no data crc32 recorded yet (not persisted); header checks only",
                         where)
        with ShardReader(seg.path, h.data_offset) as rd:
            if os.fstat(rd.fd).st_ino != seg.inode:
                raise _TornRead(f"{where} was replaced while it was read")
            layout.restore(state_dict, m["skeleton"], m["table"], None, where,
                           fill=lambda e, dst: rd.submit(dst, e.offset))
            rd.drain()
        with seg.locked():
            h2 = seg.read_header()
        if h2.seq != h.seq or not shm.holds_step(h2):
            raise _TornRead(f"{where} was overwritten while it was read")

    def _load_disk(self, state_dict: dict, step: int) -> None:
        step_dir = os.path.join(self.dir, step_dir_name(step))
        data_name, meta_name = storage.rank_files(self.rank)
        with open(os.path.join(step_dir, meta_name), "rb") as f:
            m = layout.unpack_meta(f.read())
        if m.get("rank") != self.rank or m.get("step") != step:
            raise CorruptCheckpointError(f"{step_dir}: rank file {self.rank} holds rank "
                                         f"{m.get('rank')} step {m.get('step')}")
        with ShardReader(os.path.join(step_dir, data_name)) as rd:
            layout.restore(state_dict, m["skeleton"], m["table"], None,
                           f"{step_dir} rank {self.rank}",
                           fill=lambda e, dst: rd.submit(dst, e.offset))
            rd.drain()

    def _all_ok(self, err: BaseException | None) -> list[str]:
        """Errors of every rank (empty: all succeeded)."""
        msg = None if err is None else f"rank {self.rank}: {type(err).__name__}: {err}"
        return [e for e in self._gather(msg) if e]

    def load(self, state_dict: dict, step: int | None = None) -> int | None:
        """Load the newest step (or ``step``) into ``state_dict`` in place: from shared
        memory when every rank holds it (its own buffer, a replica in a peer's memory,
        or every rank's buffer of another world size on this node), else from the
        newest committed step on disk whose files match its manifest (resharded when
        it was saved by another world size, or by this one in another layout, such as
        TP=2 -> TP=1 x DP=2, when every saved rank's buffer or file is readable here).
        Sets :attr:`last_load_source` (``memory``, ``replica``, ``memory-resharded``,
        ``disk``, ``disk-resharded``).
        Then reserves the buffers for this state in the background (first save at
        steady speed).

        Returns the step, or ``None`` when there is none.
        Raises:
            LayoutError: the saved state does not fit the live one (another model or
                world size), from memory and from disk alike.
        """
        self.last_load_source = None
        self._wait_reserve()
        try:
            return self._load(state_dict, step)
        finally:
            # the persister is looked up (or started: it removes stale buffers of dead
            # jobs) in the background thread since the saver was made; a load reads
            # the buffers by name and does not wait for it (the first save does), and
            # the reservation below runs in the same thread after it
            try:  # lay out the buffers for this state before the first save
                self.reserve_for(state_dict)
            except Exception as exc:  # noqa: BLE001 - the first save lays them out then
                log.warning("could not reserve the flash buffers: %s", exc)

    def _load(self, state_dict: dict, step: int | None) -> int | None:
        own = self._memory_steps()
        reps = self._replica_steps() if self.opts.replicas else {}
        old_world, other = self._other_world_steps()
        mine = sorted(set(own) | set(reps))
        held = self._gather((mine, sorted(other), old_world))
        common = set(held[0][0]).intersection(*(set(h[0]) for h in held[1:]))
        worlds = {h[2] for h in held}
        common_other = set(held[0][1]).intersection(*(set(h[1]) for h in held[1:])) \
            if len(worlds) == 1 else set()
        disk = committed_steps(self.dir)
        if self._dist() is not None:  # rank 0's view of the directory decides
            box = [disk]
            self._dist().broadcast_object_list(box, src=0)
            disk = box[0]
        if step is not None:
            mem = [step] if step in common | common_other else []
            disk = [step] if step in disk else []
        else:
            mem = sorted(common | common_other, reverse=True)[:1]
            if mem and disk and disk[-1] > mem[0]:
                mem = []
        for s in mem:
            err: BaseException | None = None
            source = "memory"
            try:
                if s in common:
                    if s in own:
                        self._load_memory(state_dict, s, own[s])
                    else:
                        self._load_replica(state_dict, s, reps[s])
                        source = "replica"
                else:
                    self._load_other_world(state_dict, s, other[s], where="memory")
                    source = "memory-resharded"
            except (_TornRead, CorruptCheckpointError, OSError, ValueError) as exc:
                err = exc  # LayoutError is a ValueError
            errors = self._all_ok(err)
            if errors and s in common and any("LayoutError" in e for e in errors):
                if not self._relayout(state_dict, s, "memory", errors):
                    log.warning("step %d in shared memory has another layout and cannot be "
                                "resharded from this node's buffers; trying the disk", s)
                    continue
                errors, source = [], "memory-resharded"
            if not errors:
                self.last_load_source = source
                log.info("loaded step %d from %s", s, source)
                return s
            if any("LayoutError" in e for e in errors):
                raise layout.LayoutError("; ".join(errors))
            log.warning("loading step %d from shared memory failed (%s); trying the disk",
                        s, "; ".join(errors))
        for s in sorted(disk, reverse=True):
            step_dir = os.path.join(self.dir, step_dir_name(s))
            err = None
            saved_world = self.world_size
            try:
                saved_world = storage.read_manifest(step_dir).get("world_size")
                if saved_world == self.world_size:
                    storage.verify_step(step_dir, [self.rank], self.world_size)
                else:
                    storage.verify_step(step_dir)
            except CorruptCheckpointError as exc:
                err = exc
            errors = self._all_ok(err)
            if errors:
                log.warning("skipping checkpoint step %d: %s", s, "; ".join(errors))
                continue
            try:
                if saved_world == self.world_size:
                    self._load_disk(state_dict, s)
                else:
                    self._load_other_world(state_dict, s, {
                        r: os.path.join(step_dir, storage.rank_files(r)[0])
                        for r in range(int(saved_world))}, where="disk")
            except (CorruptCheckpointError, OSError, ValueError) as exc:
                err = exc
            errors = self._all_ok(err)
            source = "disk" if saved_world == self.world_size else "disk-resharded"
            if errors and source == "disk" and self._relayout(state_dict, s, "disk", errors):
                errors, source = [], "disk-resharded"
            if errors:
                if any("LayoutError" in e for e in errors):
                    raise layout.LayoutError("; ".join(errors))
                log.warning("skipping checkpoint step %d: %s", s, "; ".join(errors))
                continue
            self.last_load_source = source
            return s
        return None

    # ------------------------------------------------------------------ other world size
    def _node_saves(self) -> dict[int, dict[int, dict[int, str]]]:
        """Complete saves in this node's buffers of :attr:`dir`, of any world size:
        ``{saved world size: {step: {saved rank: buffer path}}}`` (steps that every
        saved rank holds here). The buffers are the ranks' own slots and the replicas
        this node holds for a peer (``replicas: 1``), so a job that lost a node and
        comes back smaller on the survivor restores from memory."""
        from dlrover_plugin_flashckpt.replica import parse_replica

        holder = ""
        try:
            import ray

            if ray.is_initialized():
                holder = ray.get_runtime_context().get_node_id()[:12]
        except ImportError:
            pass
        prefix = f"{shm.job_prefix(self.job)}{shm.dir_key(self.dir)}-r"
        found: dict[int, dict[int, dict[int, tuple[int, str]]]] = {}
        for path in shm.list_segments(self.opts.shm_dir, prefix):
            rep = parse_replica(os.path.basename(path))
            if not _SLOT_RE.search(path) and not (rep and holder and rep[2] == holder):
                continue
            seg = shm.Segment.attach(path)
            if seg is None:
                continue
            try:
                h = seg.read_header()
                if not shm.holds_step(h) or seg.ident().get("dir") != self.dir:
                    continue
                ranks = found.setdefault(h.world_size, {}).setdefault(h.step, {})
                if h.rank not in ranks or ranks[h.rank][0] < h.seq:
                    ranks[h.rank] = (h.seq, path)
            finally:
                seg.close()
        return {world: full for world, steps in found.items()
                if (full := {s: {r: p for r, (_, p) in ranks.items()}
                             for s, ranks in steps.items() if len(ranks) == world})}

    def _other_world_steps(self) -> tuple[int, dict[int, dict[int, str]]]:
        """The complete saves of another world size in this node's buffers:
        ``(saved world size, {step: {saved rank: buffer path}})`` of the world size with
        the newest step (0 and ``{}`` when none)."""
        best: tuple[int, dict[int, dict[int, str]]] = (0, {})
        for world, full in self._node_saves().items():
            if world != self.world_size and (not best[1] or max(full) > max(best[1])):
                best = (world, full)
        return best

    def _relayout(self, state_dict: dict, step: int, where: str,
                  errors: list[str]) -> bool:
        """After every rank failed to load ``step`` in place and one of them with a
        ``LayoutError`` (same world size, another layout: TP=2 -> TP=1 x DP=2), restore
        it resharded from every saved rank's buffer on this node (``where="memory"``)
        or data file (``"disk"``). Collective: every rank calls it. Returns whether all
        ranks did (``False``: a buffer or file is not here or is damaged).

        Raises:
            LayoutError: the saved state cannot be placed into the live one at all
                (another model).
        """
        if not any("LayoutError" in e for e in errors):
            return False
        err: BaseException | None = None
        try:
            if where == "memory":
                paths = self._node_saves().get(self.world_size, {}).get(step)
                if paths is None:
                    raise FileNotFoundError(
                        f"step {step} has another layout and not every saved rank's flash "
                        "buffer is on this node to reshard it from")
            else:
                step_dir = os.path.join(self.dir, step_dir_name(step))
                paths = {r: os.path.join(step_dir, storage.rank_files(r)[0])
                         for r in range(self.world_size)}
            self._load_other_world(state_dict, step, paths, where=where)
        except (_TornRead, CorruptCheckpointError, OSError, ValueError) as exc:
            err = exc
        again = self._all_ok(err)
        if not again:
            return True
        if any("LayoutError" in e for e in again):
            raise layout.LayoutError("; ".join(errors + again))
        return False

    def _load_other_world(self, state_dict: dict, step: int, paths: dict[int, str],
                          where: str) -> None:
        """Restore ``step`` saved by ``len(paths)`` ranks (buffer or data-file paths by
        saved rank) into this rank of another world size (:mod:`.reshard`)."""
        from dlrover_plugin_flashckpt.reshard import RankSource, restore_resharded

        readers: list[ShardReader] = []
        checks: list[tuple[shm.Segment, int]] = []
        try:
            sources = []
            for r, path in sorted(paths.items()):
                if where == "memory":
                    seg = shm.Segment.attach(path)
                    if seg is None:
                        raise _TornRead(f"flash buffer {path} disappeared")
                    with seg.locked():
                        h = seg.read_header()
                        if not shm.holds_step(h) or h.step != step:
                            raise _TornRead(f"flash buffer {seg.name} no longer holds {step}")
                        meta = seg.meta_bytes(h)
                    if zlib.crc32(meta) != h.meta_crc:
                        raise CorruptCheckpointError(f"flash buffer {seg.name}: crc32 of the "
                                                     "meta block does not match")
                    checks.append((seg, h.seq))
                    rd = ShardReader(path, h.data_offset)
                else:
                    data_name, meta_name = storage.rank_files(r)
                    with open(os.path.join(os.path.dirname(path), meta_name), "rb") as f:
                        meta = f.read()
                    rd = ShardReader(path)
                readers.append(rd)
                m = layout.unpack_meta(meta)
                if m.get("rank") != r or m.get("step") != step:
                    raise CorruptCheckpointError(f"{path}: holds rank {m.get('rank')} step "
                                                 f"{m.get('step')}, expected rank {r} step {step}")
                sources.append(RankSource(r, m, lambda e, off, dst, rd=rd:
                                          rd.read_into(dst, e.offset + off)))
            restore_resharded(state_dict, sources, self.rank,
                              f"step {step} of world size {len(paths)} ({where})")
            for seg, seq in checks:
                h2 = seg.read_header()
                if h2.seq != seq or not shm.holds_step(h2):
                    raise _TornRead(f"flash buffer {seg.name} was overwritten while it was read")
        finally:
            for rd in readers:
                rd.close()
            for seg, _ in checks:
                seg.close()

    # ------------------------------------------------------------------ replicas
    def _replica_steps(self) -> dict[int, dict]:
        """step -> replica of this rank's save held by some node's persister
        (``{"path", "node_id", "handle"}``), newest copy per step."""
        import ray

        from dlrover_plugin_flashckpt.persister import persisters_of

        out: dict[int, dict] = {}
        try:
            handles = persisters_of(self.job)
            answers = ray.get([h.replicas.remote(self.dir, self.opts.shm_dir)
                               for h in handles.values()], timeout=60)
        except Exception as exc:  # noqa: BLE001 - no replica then
            log.warning("could not list the flash replicas: %s", exc)
            return out
        for handle, a in zip(handles.values(), answers):
            for r in a["held"]:
                if r["rank"] == self.rank and r["world_size"] == self.world_size:
                    out.setdefault(r["step"], {"path": r["path"], "node_id": a["node_id"],
                                               "handle": handle})
        return out

    def _load_replica(self, state_dict: dict, step: int, rep: dict) -> None:
        """Restore ``step`` from a replica in a peer's memory: by path when it is held
        on this node, else through the holder's persister (a Ray object)."""
        import ray

        where = f"flash replica of rank {self.rank} step {step} on node {rep['node_id'][:12]}"
        if rep["node_id"] == ray.get_runtime_context().get_node_id():
            got = None
            seg = shm.Segment.attach(rep["path"])
            if seg is None:
                raise _TornRead(f"{where} is gone")
            try:
                with seg.locked():
                    h = seg.read_header()
                    if h.state != shm.READY or h.step != step:
                        raise _TornRead(f"{where} no longer holds step {step}")
                    meta = seg.meta_bytes(h)
                with ShardReader(rep["path"], h.data_offset) as rd:
                    self._restore_from(state_dict, meta, step, where,
                                       lambda e, dst: rd.submit(dst, e.offset))
                    rd.drain()
                if seg.read_header().seq != h.seq:
                    raise _TornRead(f"{where} was overwritten while it was read")
            finally:
                seg.close()
            return
        got = ray.get(rep["handle"].read_replica.remote(rep["path"], step), timeout=600)
        data = got["data"]
        import warnings

        with warnings.catch_warnings():  # a read-only buffer, only read from
            warnings.simplefilter("ignore", UserWarning)
            self._restore_from(state_dict, got["meta"], step, where,
                               lambda e, dst: dst.copy_(layout.tensor_view(data, 0, e)))

    def _restore_from(self, state_dict: dict, meta: bytes, step: int, where: str,
                      fill: Any) -> None:
        m = layout.unpack_meta(meta)
        if m.get("rank") != self.rank or m.get("step") != step:
            raise CorruptCheckpointError(f"{where}: holds rank {m.get('rank')} step "
                                         f"{m.get('step')}")
        layout.restore(state_dict, m["skeleton"], m["table"], None, where, fill=fill)

    # ================================================================== end
    def wait(self) -> None:
        """Block until the newest save of this rank is committed to :attr:`dir` (it is
        persisted now even when not due).

        Raises:
            TimeoutError: not committed within ``options.wait_timeout_s``.
        """
        if self._newest_saved is None:
            return
        import ray

        timeout = self.opts.wait_timeout_s
        ray.get(self.persister().flush.remote(self.context.role, self._newest_saved, timeout,
                                              reg=self._registration()), timeout=timeout + 30)

    def close(self) -> None:
        """Ask the persister to persist the newest save (without waiting) and unmap the
        buffers. The buffers stay for a restart; the job's end removes them."""
        if self._persister is not None and self._newest_saved is not None:
            try:
                self._persister.flush.remote(self.context.role, self._newest_saved, wait=False,
                                             reg=self._registration())
            except Exception:  # noqa: BLE001 - Ray may be shutting down
                pass
        self._closing.set()
        self._wait_reserve()
        self._bg.shutdown(wait=True)
        self._release_slots()
