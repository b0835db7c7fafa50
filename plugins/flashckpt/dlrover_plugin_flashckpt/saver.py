"""``FlashSaver``: the ``flash`` checkpoint saver, in the training process.

Save (blocking only for the copy):

1. split the state dict into the tensor table, the tensors and the skeleton
   (:mod:`.layout`); on the first save (or when the table changes) lay out
   ``options.slots`` shared-memory buffers for this rank (:mod:`.shm`), reused after;
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

Load: every rank lists the complete saves its slots hold; when all ranks hold a
common step that is not older than the newest committed step on disk, each rank
copies its slot into the live state in place (checks: state, step, crc32 of the meta
block, the tensor table against the live tensors, the slot's sequence number before
and after the copy; with ``verify_memory: data`` also the crc32 of the data).
Otherwise, or when any rank fails, the newest committed step whose files match the
manifest is loaded; a corrupt step is skipped with a warning.
"""

from __future__ import annotations

import logging
import operator
import os
import time
import zlib
from typing import Any

from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_core.checkpoint.saver import Saver, SaverConfig, SaverContext, committed_steps, \
    step_dir_name
from dlrover_core.spec.errors import SpecError
from dlrover_plugin_flashckpt import layout, shm, storage
from dlrover_plugin_flashckpt.options import FlashOptions

log = logging.getLogger(__name__)

META_MIN = 64 << 10


class _TornRead(RuntimeError):
    """A slot changed while it was being read."""


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
        self._views: list[list[Any]] = [[] for _ in range(self.opts.slots)]
        self._pinned: list[Any] = []
        self._sig: bytes | None = None
        self._meta_cap = 0
        self._data_len = 0
        self._persister: Any = None
        self._notified: Any = None
        self._run_id: str | None = None
        self._newest_saved: int | None = None
        #: where the last :meth:`load` came from: ``memory``, ``disk`` or ``None``
        self.last_load_source: str | None = None
        #: ``{"step", "slot", "copy_s", "total_s", "bytes"}`` of the last save
        self.last_save: dict = {}
        #: ``(step, reason)`` of skipped saves
        self.skipped: list[tuple[int, str]] = []

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
                "shm_dir": self.opts.shm_dir}

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
        if self._persister is None:
            from dlrover_plugin_flashckpt.persister import get_persister

            if not ray.is_initialized():
                raise RuntimeError("the flash saver needs Ray for its per-node persister: run "
                                   "it inside a dlrover job, or call ray.init() first")
            self._persister = get_persister(self.job)
        return self._persister

    # ================================================================== layout
    def _release_slots(self) -> None:
        self._unpin()
        self._views = [[] for _ in range(self.opts.slots)]
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

    def _layout(self, table: list[layout.TensorEntry], sig: bytes, meta_len: int) -> None:
        data_len = layout.data_size(table)
        self._unpin()
        self._views = [[] for _ in range(self.opts.slots)]
        reuse = True
        for i in range(self.opts.slots):
            seg = self._attach(i)
            if seg is None:
                reuse = False
                continue
            h = seg.read_header()
            ident = seg.ident()
            if (h.sig != sig or h.meta_cap < meta_len or h.data_cap < data_len
                    or ident.get("dir") != self.dir or h.world_size != self.world_size):
                reuse = False
        if not reuse:
            self._release_slots()
            for p in self.paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            meta_cap = shm.round_up(max(META_MIN, 2 * meta_len))
            size = shm.HEADER_SIZE + meta_cap + shm.round_up(max(data_len, 1))
            shm.check_space(self.opts.shm_dir, size * self.opts.slots,
                            f"{self.opts.slots} buffers of {self.context.role or 'rank'} rank "
                            f"{self.rank} ({len(table)} tensors, {data_len} bytes each)")
            ident = self._ident()
            for i, p in enumerate(self.paths):
                self._segs[i] = shm.Segment.create(p, meta_cap, data_len, ident, sig,
                                                   self.rank, self.world_size)
        else:  # buffers of an earlier process of this rank (a restart): fault them in
            for i, p in enumerate(self.paths):
                seg = self._segs[i]
                if seg is not None and not seg.populated:
                    seg.close()
                    self._segs[i] = shm.Segment.attach(p, populate=True)
        self._ident()
        self._sig = sig
        self._meta_cap = min(s.read_header().meta_cap for s in self._segs if s is not None)
        self._data_len = data_len
        self._views = []
        for seg in self._segs:
            assert seg is not None
            h = seg.read_header()
            self._views.append([layout.tensor_view(seg.mm, h.data_offset, e) for e in table])

    def _pin(self, sources: list[Any]) -> bool:
        """Page-lock the buffers for CUDA when the state is on a GPU, so the
        device-to-host copies are DMA transfers. Returns whether they are pinned."""
        if not any(getattr(t, "is_cuda", False) for t in sources):
            return False
        if not self._pinned:
            try:
                self._pinned = shm.pin_buffers([s for s in self._segs if s is not None])
            except Exception as exc:  # noqa: BLE001 - pageable copies still work
                log.warning("could not pin the flash buffers for CUDA copies (%s); copies are "
                            "synchronous", exc)
                return False
        return True

    def _unpin(self) -> None:
        if self._pinned:
            shm.unpin_buffers(self._pinned)

    # ================================================================== save
    def _pick_slot(self, step: int, due: bool) -> int | None:
        free, done, waiting = [], [], []
        states = []
        for i in range(self.opts.slots):
            seg = self._segs[i]
            assert seg is not None
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
            assert seg is not None
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
        table, sources, skeleton = layout.build_table(state_dict)
        sig = layout.signature(table)
        meta = layout.pack_meta(step, table, skeleton,
                                {"rank": self.rank, "world_size": self.world_size})
        persister = self.persister()
        if sig != self._sig or len(meta) > self._meta_cap:
            self._layout(table, sig, len(meta))
        due = self.opts.is_due(step)
        slot = self._pick_slot(step, due)
        if slot is None:
            return
        seg = self._segs[slot]
        assert seg is not None
        t1 = time.perf_counter()
        pinned = self._pin(sources)
        for dst, src in zip(self._views[slot], sources):
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
            h.data_len, h.saved_at = self._data_len, time.time()
            h.crc_seq = 0
            seg.write_header(h)
        self._newest_saved = step
        self._notified = persister.saved.remote(self._registration(), step)
        self.last_save = {"step": step, "slot": slot, "copy_s": copy_s,
                          "total_s": time.perf_counter() - t0, "bytes": self._data_len}

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
        # map the slot again with its page tables filled in one pass (MAP_POPULATE): a
        # fresh process would otherwise take a page fault per 4 KiB during the copy
        old = self._segs[slot]
        seg = shm.Segment.attach(self.paths[slot], populate=True)
        if seg is None:
            raise _TornRead(f"flash buffer {self.paths[slot]} disappeared")
        if old is not None:
            old.close()
        self._segs[slot] = seg
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
        layout.restore(state_dict, m["skeleton"], m["table"],
                       lambda e: layout.tensor_view(seg.mm, h.data_offset, e), where)
        with seg.locked():
            h2 = seg.read_header()
        if h2.seq != h.seq or not shm.holds_step(h2):
            raise _TornRead(f"{where} was overwritten while it was read")

    def _load_disk(self, state_dict: dict, step: int) -> None:
        step_dir = os.path.join(self.dir, step_dir_name(step))
        meta, data = storage.open_rank(step_dir, self.rank)
        try:
            m = layout.unpack_meta(meta)
            if m.get("rank") != self.rank or m.get("step") != step:
                raise CorruptCheckpointError(f"{step_dir}: rank file {self.rank} holds rank "
                                             f"{m.get('rank')} step {m.get('step')}")
            layout.restore(state_dict, m["skeleton"], m["table"],
                           lambda e: layout.tensor_view(data, 0, e), f"{step_dir} rank {self.rank}")
        finally:
            if hasattr(data, "close"):
                import gc

                gc.collect()
                try:
                    data.close()
                except BufferError:
                    pass

    def _all_ok(self, err: BaseException | None) -> list[str]:
        """Errors of every rank (empty: all succeeded)."""
        msg = None if err is None else f"rank {self.rank}: {type(err).__name__}: {err}"
        return [e for e in self._gather(msg) if e]

    def load(self, state_dict: dict, step: int | None = None) -> int | None:
        """Load the newest step (or ``step``) into ``state_dict`` in place: from shared
        memory when every rank holds it, else from the newest committed step on disk
        whose files match its manifest. Sets :attr:`last_load_source`.

        Returns the step, or ``None`` when there is none.
        Raises:
            LayoutError: the saved state does not fit the live one (another model or
                world size), from memory and from disk alike.
        """
        self.last_load_source = None
        self.persister()  # a new persister first removes stale buffers of dead jobs
        mem = self._memory_steps()
        held = self._gather(sorted(mem))
        common = set(held[0]).intersection(*map(set, held[1:])) if held else set()
        disk = committed_steps(self.dir)
        if self._dist() is not None:  # rank 0's view of the directory decides
            box = [disk]
            self._dist().broadcast_object_list(box, src=0)
            disk = box[0]
        if step is not None:
            mem_step = step if step in common else None
            disk = [step] if step in disk else []
        else:
            mem_step = max(common) if common else None
            if mem_step is not None and disk and disk[-1] > mem_step:
                mem_step = None
        if mem_step is not None:
            err: BaseException | None = None
            try:
                self._load_memory(state_dict, mem_step, mem[mem_step])
            except (_TornRead, CorruptCheckpointError, OSError) as exc:
                err = exc
            except layout.LayoutError as exc:
                err = exc
            errors = self._all_ok(err)
            if not errors:
                self.last_load_source = "memory"
                log.info("loaded step %d from shared memory", mem_step)
                return mem_step
            if any("LayoutError" in e for e in errors):
                raise layout.LayoutError("; ".join(errors))
            log.warning("loading step %d from shared memory failed (%s); trying the disk",
                        mem_step, "; ".join(errors))
        for s in sorted(disk, reverse=True):
            step_dir = os.path.join(self.dir, step_dir_name(s))
            err = None
            try:
                storage.verify_step(step_dir, [self.rank], self.world_size)
            except CorruptCheckpointError as exc:
                err = exc
            errors = self._all_ok(err)
            if errors:
                log.warning("skipping checkpoint step %d: %s", s, "; ".join(errors))
                continue
            try:
                self._load_disk(state_dict, s)
            except (CorruptCheckpointError, OSError, ValueError) as exc:
                err = exc
            errors = self._all_ok(err)
            if errors:
                if any("LayoutError" in e for e in errors):
                    raise layout.LayoutError("; ".join(errors))
                log.warning("skipping checkpoint step %d: %s", s, "; ".join(errors))
                continue
            self.last_load_source = "disk"
            return s
        return None

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
        self._release_slots()
        self._sig = None
