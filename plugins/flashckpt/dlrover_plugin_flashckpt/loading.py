"""The load path of :class:`.saver.FlashSaver` (a mixin of it).

Every rank lists the complete saves it can read from memory: its own slots, with
``replicas: 1`` the replicas of its rank on any node (:mod:`.replica`), and the
buffers of every saved rank, of this or another world size, on this node (its slots
and the replicas it holds; :mod:`.reshard`). When all ranks hold a common step that
is not older than the newest committed step on disk, each rank reads it into the live
state in place, ``pread`` straight into the live tensors (:mod:`.reader`; checks:
state, step, crc32 of the meta block, the tensor table against the live tensors, the
slot's sequence number before and after the copy; with ``verify_memory: data`` also
the crc32 of the data), or resharded when the world size or the layout differs.
Otherwise, or when any rank fails, the newest committed step whose files match the
manifest is loaded (resharded when its world size or layout differs); a corrupt step
is skipped with a warning. After a load, the buffers are reserved in the background
for the loaded state.
"""

from __future__ import annotations

import logging
import os
import re
import zlib
from typing import Any

from dlrover_core.checkpoint.manifest import CheckpointLoadError, CorruptCheckpointError
from dlrover_core.checkpoint.saver import quarantine, step_dir_name
from dlrover_plugin_flashckpt import layout, shm, storage
from dlrover_plugin_flashckpt.reader import ShardReader

log = logging.getLogger("dlrover_plugin_flashckpt.saver")

_SLOT_RE = re.compile(r"-r\d{5}-s\d+$")


class _TornRead(RuntimeError):
    """A slot changed while it was being read."""


class LoadingMixin:
    """:meth:`load` and what it reads from, for :class:`.saver.FlashSaver` (which
    provides the buffers, the process group and the persister it uses)."""

    # provided by FlashSaver
    rank: int
    world_size: int
    job: str
    dir: str
    opts: Any
    paths: list[str]
    last_load_source: str | None
    _attempt: dict | None
    _next_attempt: tuple[dict, int | None] | None

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
        self._wait_reserve()
        try:
            loaded = self._load(state_dict, step)
            self._agree_attempt(loaded)
            return loaded
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
        disk = storage.lineage_steps(self.dir, check_sizes=False)  # verified below
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
        tried: dict[int, str] = {}
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
                    tried[s] = "shared memory: another layout, not reshardable from here"
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
            tried[s] = "shared memory: " + "; ".join(errors)
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
                tried[s] = "; ".join(errors)
                self._quarantine_if_damaged(s, errors)
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
                tried[s] = "; ".join(errors)
                self._quarantine_if_damaged(s, errors)
                continue
            self.last_load_source = source
            return s
        if tried:
            raise CheckpointLoadError(self.dir, tried)
        return None

    def _quarantine_if_damaged(self, step: int, errors: list[str]) -> None:
        """Rank 0 renames ``step`` to ``step_<n>.corrupt`` when a rank found a file of
        another size or crc32 than its manifest (not for a missing file or manifest:
        a prune racing the load, an NFS glitch)."""
        if self.rank == 0 and any("DamagedStepError" in e for e in errors):
            quarantine(self.dir, step, "; ".join(errors))

    def _agree_attempt(self, base: int | None) -> None:
        """Draw this incarnation's attempt (collective with a process group: every
        rank takes rank 0's epoch); the first save makes it the lineage of :attr:`dir`
        with ``base`` (the step restored) as its base (:meth:`_start_attempt`). Without
        a process group the epoch is empty when ``world_size > 1`` (the ranks cannot
        agree on a random one): the attempt is then the run id and world size only."""
        epoch = storage.new_epoch() if self._dist() is not None or self.world_size == 1 \
            else ""
        attempt = storage.make_attempt(self._ident()["run_id"], self.world_size, epoch)
        self._attempt = None
        self._next_attempt = (self._gather(attempt)[0], base)

    def _start_attempt(self) -> dict:
        """At the first save after a load (or the first save at all: collective then):
        rank 0 writes the lineage (:func:`.storage.start_lineage`) before the save's
        meta block names the attempt, so no marker of it can precede the lineage."""
        if self._next_attempt is None:
            self._agree_attempt(storage.newest_committed(self.dir) if self.rank == 0 else None)
        assert self._next_attempt is not None
        attempt, base = self._next_attempt
        if self.rank == 0:
            storage.start_lineage(self.dir, attempt, base)
        self._attempt, self._next_attempt = attempt, None
        return attempt

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
            from dlrover_plugin_flashckpt.replica import open_step

            seg, h, meta = open_step(rep["path"], step)
            try:
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
