"""``FlashSaver``: the ``flash`` checkpoint saver, in the training process.

It is composed of parts, each an object with its own state (docs/architecture.md):

- :class:`.slots.SlotPool` (``pool``): this rank's shared-memory buffers, their
  mappings, views, page locks and lock, and the ``flash-reserve`` background thread
  that lays them out and finds the persister;
- :class:`.writer.SlotWriter` (``writer``): one save into a slot of the pool, with
  its pinned staging buffers;
- :class:`.group.RankGroup` (``group``): the gather of the role's ranks (a process
  group, else the gather board actor); :class:`.group.Attempts` (``attempts``): the
  attempt every save names, agreed at a load, written as the lineage at the first save;
- :class:`.loading.Loader` (``loader``): choose the step with the other ranks, read it
  (own slot, :class:`.replica_loading.ReplicaSource`, :class:`.relayout.Relayout`,
  disk).

The saver itself owns the persister's handle and the records of the last save and
load. Every part runs in the training thread except the pool's background thread.

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
import time
from concurrent.futures import Future
from typing import Any

from dlrover_core.checkpoint.saver import Saver, SaverConfig, SaverContext
from dlrover_core.spec.errors import SpecError
from dlrover_plugin_flashckpt import layout, premap, shm, storage
from dlrover_plugin_flashckpt.group import Attempts, RankGroup
from dlrover_plugin_flashckpt.loading import Loader
from dlrover_plugin_flashckpt.meta import pack_meta
from dlrover_plugin_flashckpt.options import FlashOptions, local_dir
from dlrover_plugin_flashckpt.relayout import Relayout
from dlrover_plugin_flashckpt.replica_loading import ReplicaSource
from dlrover_plugin_flashckpt.slots import META_MIN, SlotPool
from dlrover_plugin_flashckpt.writer import SlotWriter

log = logging.getLogger(__name__)


class FlashSaver(Saver):
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
        paths = [os.path.join(self.opts.shm_dir,
                              shm.slot_name(self.job, self.dir, self.rank, s))
                 for s in range(self.opts.slots)]
        self._run_id: str | None = None
        premap.settle(paths)   # a promoted standby keeps its mappings of these slots only
        # the parts (docs/architecture.md, "The flash saver")
        self.pool = SlotPool(self.opts, paths, self.rank, self.world_size, self.dir,
                             context.role, self._ident)
        self.writer = SlotWriter(self.pool)
        self.group = RankGroup(self.job, self.dir, self.rank, self.world_size,
                               context.distributed)
        self.attempts = Attempts(self.group, lambda: self._ident()["run_id"])
        self.loader = Loader(
            self.pool, self.group,
            ReplicaSource(self.job, self.dir, self.opts.shm_dir, self.rank, self.world_size)
            if self.opts.replicas else None,
            Relayout(self.job, self.dir, self.opts.shm_dir, self.rank, self.world_size,
                     self.group.all_ok), self.opts, self.dir)
        self._persister: Any = None
        self._persister_future: Future | None = None
        self._notified: Any = None
        #: where the last :meth:`load` came from: ``memory``, ``disk`` or ``None``
        self.last_load_source: str | None = None
        #: ``{"step", "slot", "copy_s", "total_s", "bytes"}`` of the last save
        self.last_save: dict = {}
        # the background thread started now, and the persister found in it while the
        # trainer sets up, or after a load that copies from filled mappings (it slows it)
        self.pool.background(self._ident)   # the run id, cached (given in a job)
        if not premap.holds(paths):
            self._find_persister_soon()
        if self.opts.reserve_mib:
            self.reserve(int(self.opts.reserve_mib * 2**20))

    @classmethod
    def prepare_standby(cls, config: SaverConfig, context: SaverContext) -> None:
        """In a warm standby: keep this node's slots of the role's checkpoint directory
        mapped with their page tables filled until the standby is promoted
        (:mod:`.premap`), so that its first load copies from memory at memcpy speed
        instead of ``pread``-ing. Bad options are left for the promoted rank to raise."""
        try:
            opts = FlashOptions.parse(config.options)
            directory = os.path.abspath(local_dir(config.dir))
        except SpecError:
            return
        if os.path.isdir(opts.shm_dir):
            premap.start(opts.shm_dir, config.job or "job", directory)

    # ================================================================== the pool's
    @property
    def paths(self) -> list[str]:
        """The paths of this rank's buffers, one per slot."""
        return self.pool.paths

    @property
    def skipped(self) -> list[tuple[int, str]]:
        """``(step, reason)`` of skipped saves."""
        return self.pool.skipped

    @property
    def last_reserve(self) -> dict:
        """``{"data_bytes", "meta_bytes", "seconds"}`` of the last finished reservation."""
        return self.pool.last_reserve

    def reserve(self, data_bytes: int, meta_bytes: int = META_MIN, wait: bool = False,
                grow: bool = False) -> Future:
        """:meth:`.slots.SlotPool.reserve`."""
        return self.pool.reserve(data_bytes, meta_bytes, wait, grow)

    def reserve_for(self, state_dict: dict, wait: bool = False) -> Future:
        """:meth:`.slots.SlotPool.reserve_for`."""
        return self.pool.reserve_for(state_dict, wait)

    def wait_reserved(self) -> None:
        """Block until the background layout of the buffers (if any) is done."""
        self.pool.wait_reserved()

    # ================================================================== helpers
    def _ident(self) -> dict:
        from dlrover_plugin_flashckpt import hygiene

        if self._run_id is None:
            self._run_id = self.config.run_id or hygiene.master_run_id(self.job) or ""
        return {"job": self.job, "role": self.context.role, "rank": self.rank,
                "world_size": self.world_size, "dir": self.dir,
                "session": hygiene.current_session(), "run_id": self._run_id}

    def _registration(self) -> dict:
        return {"role": self.context.role, "rank": self.rank, "world_size": self.world_size,
                "dir": self.dir, "keep": self.config.keep, "slots": list(self.pool.paths),
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

    def _find_persister_soon(self) -> None:
        """:meth:`_find_persister` in the background thread, once; not without Ray."""
        import ray

        if ray.is_initialized() and self._persister is None and self._persister_future is None:
            self._persister_future = self.pool.background(self._find_persister)

    def _find_persister(self) -> Any:
        from dlrover_plugin_flashckpt.persister import get_persister

        import ray

        self._ident()  # the run id, looked up once
        handle = get_persister(self.job, shm_dir=self.opts.shm_dir)
        # register now: the first actor call opens its connection (ms the save would pay)
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
        if not self.pool.growing:  # the first layout: wait for it rather than do it twice
            self.pool.wait_reserved()
        with self.pool.lock:
            self._save(step, state_dict, t0)

    def _save(self, step: int, state_dict: dict, t0: float) -> None:
        table, sources, skeleton = layout.build_table(state_dict)
        attempt = self.attempts.current
        if attempt is None:  # the first save of this attempt
            attempt = self.attempts.start()
        meta = pack_meta(step, table, skeleton,
                         {"rank": self.rank, "world_size": self.world_size}) \
            + storage.attempt_trailer(attempt)
        persister = self.persister()
        written = self.writer.write(step, table, sources, meta, self.opts.is_due(step))
        if written is None:
            return
        self._notified = persister.saved.remote(self._registration(), step)
        self.last_save = {"step": step, "slot": written["slot"], "copy_s": written["copy_s"],
                          "laid_out": written["laid_out"], "total_s": time.perf_counter() - t0,
                          "bytes": written["bytes"]}
        if written["laid_out"] and self.opts.slots > 1 and not self.pool.reserving():
            # the others grow in the background (an older growth: let it finish)
            data_len = written["bytes"]
            self.pool.reserve(data_len + data_len // 8, 2 * len(meta) + META_MIN, grow=True)

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
        steady speed; the restored save's sizes when it came from this rank's buffer).

        A committed step whose files fail their check (size, crc32) is quarantined
        (renamed ``step_<n>.corrupt``) and the next older one is tried. A load draws
        a new attempt token shared by every rank; the first save after it makes it
        the lineage of :attr:`dir` with the loaded step as its base (a load alone
        changes nothing on disk but quarantines).

        Returns the step, or ``None`` when there is none (no committed step and no
        complete save in memory).
        Raises:
            LayoutError: the saved state does not fit the live one (another model or
                world size), from memory and from disk alike.
            CheckpointLoadError: saves exist but none loaded (``tried``: each step and
                why); the live state may have been partly overwritten, so training
                must not go on from it.
        """
        self.last_load_source = None
        self.pool.wait_reserved()
        try:
            loaded, self.last_load_source = self.loader.load(state_dict, step)
            self.attempts.agree(loaded)
            return loaded
        finally:
            # the persister is looked up (or started: it removes stale buffers of dead
            # jobs) in the background thread since the saver was made, or from here on
            # (see __init__); a load reads the buffers by name and does not wait for it
            # (the first save does); the reservation below runs in that thread too
            try:  # lay out the buffers for this state before the first save
                self.pool.reserve_for(state_dict, known=self.loader.last_layout)
            except Exception as exc:  # noqa: BLE001 - the first save lays them out then
                log.warning("could not reserve the flash buffers: %s", exc)
            self._find_persister_soon()   # last: its Ray calls hold the GIL (see __init__)

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
        newest = self.pool.newest_saved
        if newest is None:
            return
        import ray

        timeout = self.opts.wait_timeout_s
        ray.get(self.persister().flush.remote(self.context.role, newest, timeout,
                                              reg=self._registration()), timeout=timeout + 30)

    def drain(self) -> None:
        """Called when the rank's ``run()`` returns: block until this rank's newest save
        is committed to :attr:`dir` (:meth:`wait`), so that the rank finishes, and the
        job succeeds, only with its final step on disk. A node lost between the last
        step and the job's end then fails the rank and the job recovers and saves that
        step again, instead of ending "succeeded" with the step in the lost node's
        memory only (found by the chaos run, seed 52).

        Raises:
            TimeoutError: as :meth:`wait`.
        """
        self.wait()

    def close_for_resetup(self) -> None:
        """:meth:`close`, keeping this process's filled mappings of the slots for the
        saver its re-setup in place makes next (:func:`.premap.hand_over`): that saver
        loads through them (a memcpy) instead of with ``preadv``."""
        self.close(hand_over=True)

    def close(self, hand_over: bool = False) -> None:
        """Ask the persister to persist the newest save (the request is waited for, not
        the write: the job's end must find the save registered in the threaded actor,
        whose calls may run out of order) and unmap the buffers (``hand_over``: see
        :meth:`close_for_resetup`). The buffers stay for a restart; the job's end
        removes them."""
        newest = self.pool.newest_saved
        if self._persister is not None and newest is not None:
            try:
                import ray

                ray.get(self._persister.flush.remote(self.context.role, newest,
                                                     wait=False, reg=self._registration()),
                        timeout=30)
            except Exception as exc:  # noqa: BLE001 - Ray may be shutting down
                log.warning("asking the flash persister to persist step %s at close "
                            "failed: %s", newest, exc)
        self.pool.close(hand_over=hand_over)
