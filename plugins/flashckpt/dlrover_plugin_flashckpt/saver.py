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
2. pick a slot (:mod:`.slots`): an empty one, else the one with the oldest step that is neither
   being persisted nor waiting to be; a step that is due for persistence may also
   replace a newer-step slot still waiting (it supersedes it). When every slot is
   being persisted or waiting, the save is **skipped** and logged: it never waits,
   because waiting would stall training for a disk write (the issue's "blocks only for
   the copy"), and the step it would have replaced is on its way to disk;
3. mark the slot WRITING, ``tensor.copy_`` every tensor into it (raw bytes; DTensors
   their local shard; CUDA tensors by DMA into the page-locked buffer, or through
   pinned staging buffers, :mod:`.staging`, when the buffer cannot be page-locked),
   write the meta block (tagged JSON, never pickled), mark it READY with the step, a
   crc32 of the meta block and the writer;
4. notify the node's persister (one non-blocking actor call) and return.

Persist, breakpoint save and the commit run in the persister (:mod:`.persister`).

Load (:mod:`.loading`): from this rank's buffers, a replica in a peer's memory, every
saved rank's buffers on this node (resharded), or the newest committed step on disk.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from dlrover_core.checkpoint.saver import Saver, SaverConfig, SaverContext
from dlrover_core.crashpoints import crashpoint, declare
from dlrover_core.spec.errors import SpecError
from dlrover_plugin_flashckpt import layout, shm, staging, storage
from dlrover_plugin_flashckpt.loading import LoadingMixin
from dlrover_plugin_flashckpt.meta import pack_meta
from dlrover_plugin_flashckpt.options import FlashOptions, local_dir
from dlrover_plugin_flashckpt.slots import META_MIN, SlotsMixin

log = logging.getLogger(__name__)

declare("flash.save.copied", "state", "save",
        "the state is copied into the WRITING slot; its meta block is not written yet")
declare("flash.save.ready", "state", "save", "the slot is about to be marked READY")

#: seconds a rank without a process group waits for the others at a load's gather
GATHER_TIMEOUT_S = 60.0


class FlashSaver(LoadingMixin, SlotsMixin, Saver):
    """The ``flash`` saver (see the module docstring).

    Args:
        config: ``dir`` (the role's checkpoint directory, shared by every node),
            ``keep`` (committed steps kept, >= 1), ``job`` (names the buffers),
            ``options`` (:class:`FlashOptions`).
        context: rank, world size, and whether a torch.distributed group is up (used
            to agree on the step at load; without one the ranks agree through a Ray
            actor, :mod:`.agreement`).
    Raises:
        SpecError: a bad option or ``keep``, ``options.shm_dir`` is not a directory,
            or ``dir`` is a URI other than ``file://``.
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
        self.dir = os.path.abspath(local_dir(config.dir))
        from dlrover_plugin_flashckpt.hygiene import record_shm_dir

        record_shm_dir(self.job, self.opts.shm_dir)  # for `dlrover delete` on this machine
        self.rank, self.world_size = context.rank, context.world_size
        self.paths = [os.path.join(self.opts.shm_dir,
                                   shm.slot_name(self.job, self.dir, self.rank, s))
                      for s in range(self.opts.slots)]
        self._segs: list[shm.Segment | None] = [None] * self.opts.slots
        #: slot -> (layout signature, segment, tensor views into it)
        self._views: dict[int, tuple[bytes, shm.Segment, list[Any]]] = {}
        self._pinned: list[Any] = []
        self._pinned_segs: list[int] = []
        self._staging = staging.HostStaging()
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
        #: gather board and round of ranks without a process group (``_gather``)
        self._board: Any = None
        self._gather_round = 0
        self._newest_saved: int | None = None
        #: this incarnation's attempt (storage.make_attempt), set by load() or the
        #: first save; every save's meta block names it
        self._attempt: dict | None = None
        self._next_attempt: tuple[dict, int | None] | None = None
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
        """``obj`` of every rank of the role, in rank order: ``all_gather_object`` with a
        process group, else through the role's gather board (:mod:`.agreement`), so
        ranks without a group still choose the same step at load. ``[obj]`` alone when
        this is the only rank, or when the board cannot be reached or the others do
        not post within ``GATHER_TIMEOUT_S`` (logged)."""
        dist = self._dist()
        if dist is not None:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, obj)
            return out
        if self.world_size <= 1:
            return [obj]
        try:
            import ray

            from dlrover_plugin_flashckpt.agreement import board_for

            if not ray.is_initialized():
                raise RuntimeError("this process is not connected to Ray")
            if self._board is None:
                self._board = board_for(self.job, self.dir)
            self._gather_round += 1
            got = ray.get(self._board.gather.remote(self._gather_round, self.rank, obj,
                                                    self.world_size, GATHER_TIMEOUT_S),
                          timeout=GATHER_TIMEOUT_S + 30)
        except Exception as exc:  # noqa: BLE001 - deciding alone is what it did before
            self._board = None
            log.warning("flash saver rank %d could not agree with the other ranks (%s: %s); "
                        "it decides alone", self.rank, type(exc).__name__, exc)
            return [obj]
        if got is None:
            log.warning("flash saver rank %d: not every rank of %d reached gather %d within "
                        "%g s; it decides alone", self.rank, self.world_size,
                        self._gather_round, GATHER_TIMEOUT_S)
            return [obj]
        return got

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
                "shm_dir": self.opts.shm_dir, "replicas": self.opts.replicas,
                "replica_transport": self.opts.replica_transport}

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
        handle = get_persister(self.job, shm_dir=self.opts.shm_dir)
        # register now: the first call to an actor opens the connection to it, tens of
        # ms that the first save would otherwise pay
        ray.get(handle.saved.remote(self._registration()), timeout=60)
        return handle

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
                shard; CPU or CUDA) and small values of the types
                :func:`.meta.pack_meta` stores (no arbitrary objects).
        Raises:
            ValueError: a negative step. TypeError: an unsupported tensor or value.
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
        if self._attempt is None:  # the first save of this attempt
            self._start_attempt()
        assert self._attempt is not None
        meta = pack_meta(step, table, skeleton,
                                {"rank": self.rank, "world_size": self.world_size}) \
            + storage.attempt_trailer(self._attempt)
        data_len = layout.data_size(table)
        persister = self.persister()
        due = self.opts.is_due(step)
        picked = self._pick_slot(step, due)
        if picked is None:
            return
        slot, before = picked
        seg = self._segs[slot]
        laid_out = seg is None or not self._fits(seg, data_len, len(meta))
        if laid_out:
            t_grow = time.perf_counter()
            # room for a little growth, so that a slightly larger state does not pay again
            try:
                seg = self._ensure_slot(slot, data_len + data_len // 8,
                                        2 * len(meta) + META_MIN, claimed=seg is not None)
            except BaseException:
                if seg is not None and before is not None:  # nothing was written into it
                    self._unpick(slot, seg, before)
                raise
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
        if self._pin(sources):
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

    def committed_steps(self) -> list[int]:
        """Committed steps of the current lineage, oldest first: not quarantined, of
        the attempt that restored the lineage's base or older, with every file of the
        size its manifest gives (:func:`.storage.lineage_steps`)."""
        return storage.lineage_steps(self.dir)

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
        """Ask the persister to persist the newest save (the request is waited for, not
        the write: the job's end must find the save registered in the threaded actor,
        whose calls may run out of order) and unmap the buffers. The buffers stay for a
        restart; the job's end removes them."""
        if self._persister is not None and self._newest_saved is not None:
            try:
                import ray

                ray.get(self._persister.flush.remote(self.context.role, self._newest_saved,
                                                     wait=False, reg=self._registration()),
                        timeout=30)
            except Exception as exc:  # noqa: BLE001 - Ray may be shutting down
                log.warning("asking the flash persister to persist step %s at close "
                            "failed: %s", self._newest_saved, exc)
        self._closing.set()
        self._wait_reserve()
        self._bg.shutdown(wait=True)
        self._release_slots()
