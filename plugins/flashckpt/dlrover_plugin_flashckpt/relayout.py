"""The resharding part of a load of :class:`.saver.FlashSaver` (:class:`Relayout`,
used by the :class:`.loading.Loader`): find the complete saves in this node's buffers
of any world size (the ranks' own slots and the replicas this node holds), and
restore one resharded (:mod:`.reshard`) from every saved rank's buffer or data file.

It owns no buffer: it maps the buffers it reads for the length of one restore (read
only, checked against their sequence numbers afterwards) and opens the step's data
files. It runs in the training thread; its reads run in the pool of
:func:`.reader.read_pool`.
"""

from __future__ import annotations

import os
import re
from typing import Callable

from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_core.checkpoint.saver import step_dir_name
from dlrover_plugin_flashckpt import layout, shm, storage
from dlrover_plugin_flashckpt.meta import unpack_meta
from dlrover_plugin_flashckpt.reader import ShardReader, TornRead, read_pool, step_meta
from dlrover_plugin_flashckpt.replica_buffers import buffer_tag_at, folder_buffers, parse_replica
from dlrover_plugin_flashckpt.reshard import RankSource, restore_resharded

#: the name of a rank's own slot (not a replica)
_SLOT_RE = re.compile(r"-r\d{5}-s\d+$")


class Relayout:
    """Restores of another world size or layout (see the module docstring).

    Args:
        job, directory, shm_dir: whose buffers, and where they are.
        rank, world_size: this rank.
        all_ok: the collective check of every rank's error (:meth:`.group.RankGroup.all_ok`).
    """

    def __init__(self, job: str, directory: str, shm_dir: str, rank: int, world_size: int,
                 all_ok: Callable[[BaseException | None], list[str]]) -> None:
        self.job, self.dir, self.shm_dir = job, directory, shm_dir
        self.rank, self.world_size = rank, world_size
        self._all_ok = all_ok

    def node_saves(self, skip_world: int | None = None
                   ) -> dict[int, dict[tuple[int, str], dict[int, str]]]:
        """Complete saves in this node's buffers of :attr:`dir`, of any world size but
        ``skip_world``: ``{saved world size: {(step, attempt tag): {saved rank: buffer
        path}}}`` (saves that every saved rank of one attempt holds here). The buffers
        are the ranks' own slots and the replicas this node holds for a peer
        (``replicas: 1``), so a job that lost a node and comes back smaller on the
        survivor restores from memory. A buffer of ``skip_world`` is left at its header
        (its meta block, which names the attempt, is not read)."""
        holder = ""
        try:
            import ray

            if ray.is_initialized():
                holder = ray.get_runtime_context().get_node_id()[:12]
        except ImportError:
            pass

        def here(name: str) -> bool:  # a slot, or a replica this node holds
            rep = parse_replica(name)
            return bool(_SLOT_RE.search(name)) or bool(rep and holder and rep[2] == holder)

        found: dict[int, dict[tuple[int, str], dict[int, tuple[int, str]]]] = {}
        for path, h in folder_buffers(self.shm_dir, self.job, self.dir, here):
            if not shm.holds_step(h) or h.world_size == skip_world:
                continue
            key = (h.step, buffer_tag_at(path, h))
            ranks = found.setdefault(h.world_size, {}).setdefault(key, {})
            if h.rank not in ranks or ranks[h.rank][0] < h.seq:
                ranks[h.rank] = (h.seq, path)
        return {world: full for world, saves in found.items()
                if (full := {k: {r: p for r, (_, p) in ranks.items()}
                             for k, ranks in saves.items() if len(ranks) == world})}

    def other_world_steps(self) -> tuple[int, dict[tuple[int, str], dict[int, str]]]:
        """The complete saves of another world size in this node's buffers:
        ``(saved world size, {(step, attempt tag): {saved rank: buffer path}})`` of the
        world size with the newest step (0 and ``{}`` when none)."""
        best: tuple[int, dict[tuple[int, str], dict[int, str]]] = (0, {})
        for world, full in self.node_saves(skip_world=self.world_size).items():
            if world != self.world_size and (not best[1] or max(full) > max(best[1])):
                best = (world, full)
        return best

    def relayout(self, state_dict: dict, step: int, where: str,
                  errors: list[str], tag: str | None = None) -> bool:
        """After every rank failed to load ``step`` in place and one of them with a
        ``LayoutError`` (same world size, another layout: TP=2 -> TP=1 x DP=2), restore
        it resharded from every saved rank's buffer on this node of the save of attempt
        ``tag`` (``where="memory"``) or data file (``"disk"``). Collective: every rank
        calls it. Returns whether all ranks did (``False``: a buffer or file is not here
        or is damaged).

        Raises:
            LayoutError: the saved state cannot be placed into the live one at all
                (another model).
        """
        if not any("LayoutError" in e for e in errors):
            return False
        err: BaseException | None = None
        try:
            if where == "memory":
                paths = self.node_saves().get(self.world_size, {}).get((step, tag or ""))
                if paths is None:
                    raise FileNotFoundError(
                        f"step {step} has another layout and not every saved rank's flash "
                        "buffer is on this node to reshard it from")
            else:
                step_dir = os.path.join(self.dir, step_dir_name(step))
                paths = {r: os.path.join(step_dir, storage.rank_files(r)[0])
                         for r in range(self.world_size)}
            self.load_other_world(state_dict, step, paths, where=where)
        except (TornRead, CorruptCheckpointError, OSError, ValueError) as exc:
            err = exc
        again = self._all_ok(err)
        if not again:
            return True
        if any("LayoutError" in e for e in again):
            raise layout.LayoutError("; ".join(errors + again))
        return False

    def load_other_world(self, state_dict: dict, step: int, paths: dict[int, str],
                          where: str) -> None:
        """Restore ``step`` saved by ``len(paths)`` ranks (buffer or data-file paths by
        saved rank) into this rank of another world size (:mod:`.reshard`)."""
        readers: list[ShardReader] = []
        checks: list[tuple[shm.Segment, int]] = []
        pool = read_pool()  # every saved rank's reads in one pool of reader_threads()
        try:
            sources = []
            for r, path in sorted(paths.items()):
                if where == "memory":
                    seg = shm.Segment.attach(path)
                    if seg is None:
                        raise TornRead(f"flash buffer {path} disappeared")
                    h, meta = step_meta(seg, step, f"flash buffer {seg.name}")
                    checks.append((seg, h.seq))
                    rd = ShardReader(path, h.data_offset, pool)
                else:
                    data_name, meta_name = storage.rank_files(r)
                    with open(os.path.join(os.path.dirname(path), meta_name), "rb") as f:
                        meta = f.read()
                    rd = ShardReader(path, pool=pool)
                readers.append(rd)
                m = unpack_meta(meta)
                if m.get("rank") != r or m.get("step") != step:
                    raise CorruptCheckpointError(f"{path}: holds rank {m.get('rank')} step "
                                                 f"{m.get('step')}, expected rank {r} step {step}")
                sources.append(RankSource(
                    r, m, lambda e, off, dst, rd=rd: rd.read_into(dst, e.offset + off),
                    lambda e, off, dst, rd=rd: rd.submit(dst, e.offset + off)))
            restore_resharded(state_dict, sources, self.rank,
                              f"step {step} of world size {len(paths)} ({where})")
            for rd in readers:  # every overlap's read, all started above
                rd.drain()
            for seg, seq in checks:
                h2 = seg.read_header()
                if h2.seq != seq or not shm.holds_step(h2):
                    raise TornRead(f"flash buffer {seg.name} was overwritten while it was read")
        finally:
            for rd in readers:
                rd.close()
            pool.shutdown(wait=True)
            for seg, _ in checks:
                seg.close()
