"""The loader of :class:`.saver.FlashSaver` (:class:`Loader`): choose the step to
load with the other ranks, read it into the live state, relayout it when needed.

Parts it calls: the rank's :class:`.slots.SlotPool` (its own buffers, read only), the
:class:`.group.RankGroup` (the gather of what every rank holds, and of every rank's
error after each read), the :class:`.replica_loading.ReplicaSource` (replicas in a
peer's memory) and the :class:`.relayout.Relayout` (saves of another world size or
layout). It owns nothing but the steps it tried; it renames a damaged committed step
(rank 0, :func:`dlrover_core.checkpoint.saver.quarantine`). Runs in the training
thread, collectively on every rank (each read is followed by a gather).

Every rank lists the complete saves it can read from memory: its own slots, with
``replicas: 1`` the replicas of its rank on any node (:mod:`.replica`), and the
buffers of every saved rank, of this or another world size, on this node (its slots
and the replicas it holds; :mod:`.reshard`). When all ranks hold a common step that
is not older than the newest committed step on disk, each rank reads it into the live
state in place: a copy from its own mapping of the buffer when this process filled
that mapping's page tables (it saved through it: an in-place survivor), else
``pread`` straight into the live tensors (:mod:`.reader`), or resharded when the
world size or the layout differs. Checks: state, step, crc32 of the meta block, the
tensor table against the live tensors, the slot's sequence number before and after
the copy; with ``verify_memory: data`` also the crc32 of the data.
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

import torch

from dlrover_core.checkpoint.manifest import CheckpointLoadError, CorruptCheckpointError
from dlrover_core.checkpoint.saver import quarantine, step_dir_name
from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import layout, shm, storage
from dlrover_plugin_flashckpt.choice import Held, buffer_tag, plan
from dlrover_plugin_flashckpt.meta import unpack_meta
from dlrover_plugin_flashckpt.reader import ShardReader, TornRead, copy_bytes, step_meta
from dlrover_plugin_flashckpt.group import RankGroup
from dlrover_plugin_flashckpt.relayout import Relayout
from dlrover_plugin_flashckpt.replica_loading import ReplicaSource
from dlrover_plugin_flashckpt.slots import SlotPool

log = logging.getLogger("dlrover_plugin_flashckpt.saver")

#: a gathered error (:meth:`.group.RankGroup.all_ok`) that is an I/O error of the read,
#: not a damaged or missing file
_IO_ERROR = re.compile(r"^rank \d+: (OSError|PermissionError|TimeoutError|InterruptedError"
                       r"|BlockingIOError|ConnectionError): ")

declare("flash.load.gather", "state", "load",
        "a rank listed what it holds and is about to gather with the other ranks")
declare("flash.load.memory_read", "io", "load", "reading a save from shared memory")
declare("flash.load.verify", "io", "load", "verifying a committed step's files")
declare("flash.load.disk_read", "io", "load", "reading a committed step from disk")


class Loader:
    """Loads a step into the live state (see the module docstring).

    Args:
        pool: this rank's buffers. group: the ranks of the role.
        replicas: the replicas of this rank's saves (``None``: ``replicas: 0``).
        relayout: the restores of another world size or layout.
        opts: the saver's options (``verify_memory``).
        directory: the role's checkpoint directory.
    """

    def __init__(self, pool: SlotPool, group: RankGroup, replicas: ReplicaSource | None,
                 relayout: Relayout, opts: Any, directory: str) -> None:
        self.pool, self.group, self.replicas, self.relayout = pool, group, replicas, relayout
        self.opts, self.dir = opts, directory
        self.rank, self.world_size = group.rank, group.world_size
        #: how the newest load from this rank's own buffer read the data: ``"mapping"``
        #: (a copy from this process's populated mapping) or ``"pread"``; ``None``
        #: before any
        self.last_memory_read: str | None = None
        #: ``(data bytes, meta bytes)`` of the save the last :meth:`load` restored in
        #: place from this rank's own buffer (the live state has that layout now);
        #: ``None`` when it loaded otherwise or nothing
        self.last_layout: tuple[int, int] | None = None

    def _memory_steps(self) -> dict[tuple[int, str], int]:
        """``(step, attempt tag) -> slot`` of the complete saves this rank's buffers
        hold (:func:`.choice.buffer_tag`; the newest copy of each pair)."""
        out: dict[tuple[int, str], tuple[int, int]] = {}
        for i in range(self.opts.slots):
            seg = self.pool.attach(i)
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
        seg = self.pool.attach(slot)
        if seg is None:
            raise TornRead(f"flash buffer {self.pool.paths[slot]} disappeared")
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
        # warm: this process mapped the buffer with its page tables filled (its own
        # saves went through it), so a contiguous CPU or GPU tensor is copied from the
        # mapping (a memcpy; CPU tensors over the reader's threads at drain()); otherwise
        # pread into it (no page tables to fill)
        warm = seg.populated
        self.last_memory_read = "mapping" if warm else "pread"
        with ShardReader(seg.path, h.data_offset) as rd:
            if os.fstat(rd.fd).st_ino != seg.inode:
                raise TornRead(f"{where} was replaced while it was read")

            def fill(e: Any, dst: Any) -> None:
                nbytes = dst.numel() * dst.element_size()
                if not warm or not dst.is_contiguous():
                    rd.submit(dst, e.offset)
                    return
                if e.offset < 0 or e.offset + nbytes > h.data_len:
                    raise CorruptCheckpointError(
                        f"{where}: tensor at bytes {e.offset}-{e.offset + nbytes} lies "
                        f"outside the data block of {h.data_len} bytes")
                if dst.device.type == "cpu":  # drain() copies, over the reader's threads
                    rd.copy_from(dst.view(-1), seg.mm, h.data_offset + e.offset)
                elif nbytes:
                    src = torch.frombuffer(seg.mm, dtype=torch.uint8, count=nbytes,
                                           offset=h.data_offset + e.offset)
                    copy_bytes(dst.view(-1), src)
                    del src  # the mapping may be closed later: hold no view of it

            layout.restore(state_dict, m["skeleton"], m["table"], None, where, fill=fill)
            rd.drain()
        with seg.locked():
            h2 = seg.read_header()
        if h2.seq != h.seq or not shm.holds_step(h2):
            raise TornRead(f"{where} was overwritten while it was read")
        self.last_layout = (h.data_len, len(meta))

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

    def load(self, state_dict: dict, step: int | None) -> tuple[int | None, str | None]:
        """Load the newest step every rank can read (or ``step``) into ``state_dict``
        (see :meth:`.saver.FlashSaver.load`). Collective.

        Returns ``(step, source)``, ``(None, None)`` when there is nothing to load.
        Raises:
            LayoutError, CheckpointLoadError: as :meth:`.saver.FlashSaver.load`.
        """
        self.last_layout = None
        own = self._memory_steps()
        reps = self.replicas.steps() if self.replicas is not None else {}
        old_world, other = self.relayout.other_world_steps()
        mine = Held(sorted(set(own) | set(reps)), sorted(other), old_world,
                    storage.lineage_steps(self.dir, check_sizes=False),  # verified below
                    storage.read_lineage(self.dir))
        crashpoint("flash.load.gather")
        held = [Held.from_wire(h) for h in self.group.gather(mine.to_wire())]
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
                        self.replicas.load(state_dict, s, reps[(s, tag)])
                        source = "replica"
                else:
                    self.relayout.load_other_world(state_dict, s, other[(s, tag)], where="memory")
                    source = "memory-resharded"
            except (TornRead, CorruptCheckpointError, OSError, ValueError) as exc:
                err = exc  # LayoutError is a ValueError
            errors = self.group.all_ok(err)
            if errors and kind == "own" and any("LayoutError" in e for e in errors):
                if not self.relayout.relayout(state_dict, s, "memory", errors, tag=tag):
                    log.warning("step %d in shared memory has another layout and cannot be "
                                "resharded from this node's buffers; trying the disk", s)
                    tried[s] = "shared memory: another layout, not reshardable from here"
                    continue
                errors, source = [], "memory-resharded"
            if not errors:
                log.info("loaded step %d from %s", s, source)
                return s, source
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
            errors = self.group.all_ok(err)
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
                    self.relayout.load_other_world(state_dict, s, {
                        r: os.path.join(step_dir, storage.rank_files(r)[0])
                        for r in range(int(saved_world))}, where="disk")
            except (CorruptCheckpointError, OSError, ValueError) as exc:
                err = exc
            errors = self.group.all_ok(err)
            source = "disk" if saved_world == self.world_size else "disk-resharded"
            if errors and source == "disk" and self.relayout.relayout(state_dict, s, "disk",
                                                                      errors):
                errors, source = [], "disk-resharded"
            if errors:
                if any("LayoutError" in e for e in errors):
                    raise layout.LayoutError("; ".join(errors))
                self._raise_if_unreadable(s, errors, tried)
                log.warning("skipping checkpoint step %d: %s", s, "; ".join(errors))
                tried[s] = "; ".join(errors)
                self._quarantine_if_damaged(s, errors)
                continue
            return s, source
        if tried:
            raise CheckpointLoadError(self.dir, tried)
        return None, None

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
