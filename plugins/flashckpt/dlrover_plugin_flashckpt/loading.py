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
from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import layout, shm, storage
from dlrover_plugin_flashckpt.choice import Held, buffer_tag, plan
from dlrover_plugin_flashckpt.meta import unpack_meta
from dlrover_plugin_flashckpt.reader import ShardReader, TornRead, step_meta
from dlrover_plugin_flashckpt.relayout import RelayoutMixin
from dlrover_plugin_flashckpt.replica_loading import ReplicaLoadingMixin

log = logging.getLogger("dlrover_plugin_flashckpt.saver")

#: a gathered error (:meth:`LoadingMixin._all_ok`) that is an I/O error of the read,
#: not a damaged or missing file
_IO_ERROR = re.compile(r"^rank \d+: (OSError|PermissionError|TimeoutError|InterruptedError"
                       r"|BlockingIOError|ConnectionError): ")

declare("flash.load.gather", "state", "load",
        "a rank listed what it holds and is about to gather with the other ranks")
declare("flash.load.memory_read", "io", "load", "reading a save from shared memory")
declare("flash.load.verify", "io", "load", "verifying a committed step's files")
declare("flash.load.disk_read", "io", "load", "reading a committed step from disk")
declare("flash.save.lineage_write", "io", "save",
        "rank 0's first save of an attempt writes lineage.json (attempt and base)")

class LoadingMixin(RelayoutMixin, ReplicaLoadingMixin):
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

    def _memory_steps(self) -> dict[tuple[int, str], int]:
        """``(step, attempt tag) -> slot`` of the complete saves this rank's buffers
        hold (:func:`.choice.buffer_tag`; the newest copy of each pair)."""
        out: dict[tuple[int, str], tuple[int, int]] = {}
        for i in range(self.opts.slots):
            seg = self._attach(i)
            if seg is None:
                continue
            h = seg.read_header()
            ident = seg.ident()
            if not shm.holds_step(h) or ident.get("dir") != self.dir \
                    or h.world_size != self.world_size or h.rank != self.rank:
                continue
            key = (h.step, buffer_tag(seg.meta_bytes(h)))
            if key not in out or out[key][1] < h.seq:
                out[key] = (i, h.seq)
        return {k: i for k, (i, _) in out.items()}

    def _load_memory(self, state_dict: dict, step: int, tag: str, slot: int) -> None:
        # the header and meta block through the mapping (a few pages); the data with
        # pread straight into the live tensors (reader.py): no page tables to fill
        seg = self._attach(slot)
        if seg is None:
            raise TornRead(f"flash buffer {self.paths[slot]} disappeared")
        where = f"flash buffer {seg.name} (step {step})"
        h, meta = step_meta(seg, step, where)
        if buffer_tag(meta) != tag:
            raise TornRead(f"{where} now holds a save of another attempt")
        m = unpack_meta(meta)
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
                raise TornRead(f"{where} was replaced while it was read")
            layout.restore(state_dict, m["skeleton"], m["table"], None, where,
                           fill=lambda e, dst: rd.submit(dst, e.offset))
            rd.drain()
        with seg.locked():
            h2 = seg.read_header()
        if h2.seq != h.seq or not shm.holds_step(h2):
            raise TornRead(f"{where} was overwritten while it was read")

    def _load_disk(self, state_dict: dict, step: int) -> None:
        step_dir = os.path.join(self.dir, step_dir_name(step))
        data_name, meta_name = storage.rank_files(self.rank)
        with open(os.path.join(step_dir, meta_name), "rb") as f:
            m = unpack_meta(f.read())
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
        mine = Held(sorted(set(own) | set(reps)), sorted(other), old_world,
                    storage.lineage_steps(self.dir, check_sizes=False),  # verified below
                    storage.read_lineage(self.dir))
        crashpoint("flash.load.gather")
        held = [Held.from_wire(h) for h in self._gather(mine.to_wire())]
        chosen = plan(held, self.world_size, step, self.dir)  # rank 0's lineage and disk
        mem = [chosen.memory] if chosen.memory is not None else []
        disk = chosen.disk
        if chosen.refused and self.rank == 0:
            log.warning("shared memory holds step(s) %s saved by an attempt outside the "
                        "current lineage of %s (abandoned by a rollback, or of an earlier run "
                        "whose folder was moved aside): not loaded",
                        ", ".join(map(str, chosen.refused)), self.dir)
        tried: dict[int, str] = {}
        for s, tag, kind in mem:
            err: BaseException | None = None
            source = "memory"
            try:
                crashpoint("flash.load.memory_read")
                if kind == "own":
                    if (s, tag) in own:
                        self._load_memory(state_dict, s, tag, own[(s, tag)])
                    else:
                        self._load_replica(state_dict, s, reps[(s, tag)])
                        source = "replica"
                else:
                    self._load_other_world(state_dict, s, other[(s, tag)], where="memory")
                    source = "memory-resharded"
            except (TornRead, CorruptCheckpointError, OSError, ValueError) as exc:
                err = exc  # LayoutError is a ValueError
            errors = self._all_ok(err)
            if errors and kind == "own" and any("LayoutError" in e for e in errors):
                if not self._relayout(state_dict, s, "memory", errors, tag=tag):
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
                crashpoint("flash.load.verify")
                saved_world = storage.read_manifest(step_dir).get("world_size")
                if saved_world == self.world_size:
                    storage.verify_step(step_dir, [self.rank], self.world_size)
                else:
                    storage.verify_step(step_dir)
            except (CorruptCheckpointError, OSError) as exc:
                err = exc
            errors = self._all_ok(err)
            self._raise_if_unreadable(s, errors, tried)
            if errors:
                log.warning("skipping checkpoint step %d: %s", s, "; ".join(errors))
                tried[s] = "; ".join(errors)
                self._quarantine_if_damaged(s, errors)
                continue
            try:
                crashpoint("flash.load.disk_read")
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
                self._raise_if_unreadable(s, errors, tried)
                log.warning("skipping checkpoint step %d: %s", s, "; ".join(errors))
                tried[s] = "; ".join(errors)
                self._quarantine_if_damaged(s, errors)
                continue
            self.last_load_source = source
            return s
        if tried:
            raise CheckpointLoadError(self.dir, tried)
        return None

    def _raise_if_unreadable(self, step: int, errors: list[str], tried: dict) -> None:
        """A read that failed with an I/O error (``EIO``, ``EACCES``, a timeout: the
        step's files are there and may be whole) ends the load with
        :class:`CheckpointLoadError` on every rank (each sees the same gathered
        ``errors``): falling back to an older step would resume from the wrong place
        and throw away the training since, in silence. A damaged or missing file
        (size, crc32, a prune racing the load) still falls back."""
        if any(_IO_ERROR.match(e) for e in errors):
            tried[step] = "; ".join(errors) + (
                " (an I/O error, not a damaged file: the step was not skipped for an older "
                "one; fix the storage and restart, or load(step=N) an older step on purpose)")
            raise CheckpointLoadError(self.dir, tried)

    def _quarantine_if_damaged(self, step: int, errors: list[str]) -> None:
        """Rank 0 renames ``step`` to ``step_<n>.corrupt`` when a rank found a file of
        another size or crc32 than its manifest (not for a missing file or manifest:
        a prune racing the load, an NFS glitch)."""
        if self.rank == 0 and any("DamagedStepError" in e for e in errors):
            quarantine(self.dir, step, "; ".join(errors))

    def _agree_attempt(self, base: int | None) -> None:
        """Draw this incarnation's attempt: every rank draws a random epoch and all take
        rank 0's (:meth:`_gather`: ``all_gather_object`` with a process group, else the
        gather board), so an incarnation never shares an attempt with an earlier one of
        the same run and world size. When the gather fails (the board unreachable, a
        rank missing), each rank keeps its own epoch (logged): the ranks' attempts then
        differ, so none of their saves commits until a later load agrees; nothing
        mixed can. The first save makes the attempt the lineage of :attr:`dir` with
        ``base`` (the step restored) as its base (:meth:`_start_attempt`)."""
        own = storage.make_attempt(self._ident()["run_id"], self.world_size,
                                   storage.new_epoch())
        got = self._gather(own)
        if len(got) == self.world_size and got[0] is not None:
            attempt = got[0]
        else:
            attempt = own
            log.warning("flash saver rank %d could not agree on an attempt with the other "
                        "ranks: it uses its own, so its saves are not committed until the "
                        "next load agrees", self.rank)
        self._attempt = None
        self._next_attempt = (attempt, base)

    def _start_attempt(self) -> dict:
        """At the first save after a load (or the first save at all: collective then):
        rank 0 writes the lineage (:func:`.storage.start_lineage`) before the save's
        meta block names the attempt, so no marker of it can precede the lineage."""
        if self._next_attempt is None:
            self._agree_attempt(storage.newest_committed(self.dir) if self.rank == 0 else None)
        assert self._next_attempt is not None
        attempt, base = self._next_attempt
        if self.rank == 0:
            crashpoint("flash.save.lineage_write")
            storage.start_lineage(self.dir, attempt, base)
        self._attempt, self._next_attempt = attempt, None
        return attempt

    def _restore_from(self, state_dict: dict, meta: bytes, step: int, where: str,
                      fill: Any) -> None:
        m = unpack_meta(meta)
        if m.get("rank") != self.rank or m.get("step") != step:
            raise CorruptCheckpointError(f"{where}: holds rank {m.get('rank')} step "
                                         f"{m.get('step')}")
        layout.restore(state_dict, m["skeleton"], m["table"], None, where, fill=fill)
