"""The ranks of one node that a persister serves (:class:`NodeRanks`), in the
persister actor's process. Imports no torch.

It owns the trainers' registrations (:class:`.registration.Registration`, one per
role and rank), the persister's mappings of their slot buffers (a buffer replaced by
a trainer's new layout is retired, then unmapped by the persist loop) and the lock
that guards them and the bookkeeping of the other parts of the persister (the
:class:`.persisting.PersistLoop`, the :class:`.committer.Committer`, the
:class:`.replica.ReplicaSender`). It reads the slots' headers; it writes only the
persister's identity into them (:meth:`NodeRanks.stamp`). Its methods run in the
actor's call threads and in the persister's loops (``flash-persister``,
``flash-replicate``), under :attr:`NodeRanks.lock`.
"""

from __future__ import annotations

import os
import threading

from dlrover_plugin_flashckpt import shm, storage
from dlrover_plugin_flashckpt.registration import Registration


class NodeRanks:
    """Registrations and buffer mappings of one node (see the module docstring).

    Args:
        job: the job. pid, start: the persister process's identity
            (:func:`.shm.my_identity`), stamped into the buffers it serves.
    """

    def __init__(self, job: str, pid: int, start: int) -> None:
        self.job, self.pid, self.start = job, pid, start
        #: guards the registrations, the mappings and the persister's bookkeeping
        self.lock = threading.RLock()
        #: (role, rank) -> the rank's registration
        self.regs: dict[tuple[str, int], Registration] = {}
        self._segs: dict[str, shm.Segment] = {}
        self._retired: list[shm.Segment] = []

    # ------------------------------------------------------------ registrations
    def register(self, r: Registration) -> None:
        """Remember ``r`` (replacing the ranks of an earlier run of its role with another
        world size or directory: they must not hold back the new run's persistence)
        and stamp this persister into its buffers."""
        with self.lock:
            for key, old in list(self.regs.items()):
                if old.role == r.role and (old.world_size != r.world_size or old.dir != r.dir):
                    del self.regs[key]
            self.regs[(r.role, r.rank)] = r
            for path in r.slots:
                seg = self.seg(path)
                if seg is not None:
                    self.stamp(seg)

    def roles(self) -> list[str]:
        """The registered roles, sorted."""
        return sorted({ro for ro, _ in self.regs})

    def of_role(self, role: str) -> list[Registration]:
        """The registrations of ``role`` (in registration order)."""
        return [r for (ro, _), r in self.regs.items() if ro == role]

    def reg_of(self, role: str) -> Registration:
        """One registration of ``role``. Raises: StopIteration: none."""
        return next(r for (ro, _), r in self.regs.items() if ro == role)

    # ------------------------------------------------------------ buffers
    def seg(self, path: str) -> shm.Segment | None:
        """The mapping of the buffer at ``path`` (``None``: no such buffer); a buffer
        replaced since it was mapped is mapped again (the old mapping is retired)."""
        seg = self._segs.get(path)
        if seg is not None and seg.replaced():
            self._retired.append(self._segs.pop(path))
            seg = None
        if seg is None:
            seg = shm.Segment.attach(path)
            if seg is not None:
                self._segs[path] = seg
        return seg

    def close_retired(self) -> None:
        """Unmap the mappings of replaced buffers."""
        with self.lock:
            for seg in self._retired:
                seg.close()
            self._retired.clear()

    def close_all(self) -> None:
        """Unmap every buffer."""
        with self.lock:
            for seg in list(self._segs.values()) + self._retired:
                seg.close()
            self._segs.clear()
            self._retired.clear()

    def stamp(self, seg: shm.Segment) -> None:
        """Record this process as the buffer's persister (for staleness and claims)."""
        h = seg.read_header()
        if (h.persister_pid, h.persister_start) != (self.pid, self.start):
            with seg.locked():
                h = seg.read_header()
                h.persister_pid, h.persister_start = self.pid, self.start
                seg.write_header(h)

    def rank_steps(self, r: Registration, pending_only: bool
                   ) -> dict[int, tuple[shm.Segment, shm.Header]]:
        """``step -> (buffer, header)`` of the complete saves ``r``'s slots hold (the
        newest copy of each step; ``pending_only``: not persisted yet)."""
        out: dict[int, tuple[shm.Segment, shm.Header]] = {}
        for path in r.slots:
            seg = self.seg(path)
            if seg is None:
                continue
            h = seg.read_header()
            if not shm.holds_step(h):
                continue
            # a slot's name has no world size: after a resize, this rank's buffers
            # still hold the saves of the old world (another rank's shard of another
            # layout); they are only read by a resharding load, never persisted or
            # replicated as this registration's
            if h.rank != r.rank or h.world_size != r.world_size:
                continue
            if pending_only and h.persisted_seq == h.seq:
                continue
            if h.step not in out or out[h.step][1].seq < h.seq:
                out[h.step] = (seg, h)
        return out

    def common_steps(self, regs: list[Registration], pending_only: bool = False) -> set[int]:
        """The steps every one of ``regs`` holds."""
        common: set[int] | None = None
        for r in regs:
            steps = set(self.rank_steps(r, pending_only))
            common = steps if common is None else common & steps
        return common or set()

    def pending(self, regs: list[Registration], step: int) -> list[shm.Header] | None:
        """Headers of the local ranks whose save of ``step`` is neither committed nor
        written into the step's temp directory, or ``None`` when some local rank does
        not hold ``step``."""
        out = []
        written: set | None = None
        for r in regs:
            found = self.rank_steps(r, pending_only=False).get(step)
            if found is None:
                return None
            h = found[1]
            if h.persisted_seq == h.seq:
                continue
            if written is None:
                written = storage.written_saves(r.dir, step)
            if (r.rank, h.seq, h.saved_at) not in written:
                out.append(h)
        return out

    def needs_persist(self, role: str, step: int) -> bool:
        """Whether ``step`` of ``role`` is not committed yet."""
        regs = [r for (ro, _), r in self.regs.items() if ro == role]
        newest = storage.newest_committed(regs[0].dir) if regs else None
        return newest is None or newest < step

    def written_here(self, role: str, step: int) -> bool:
        """Whether every local rank's save of ``step`` is written (or committed)."""
        return self.pending(self.of_role(role), step) in ([], None)

    # ------------------------------------------------------------ allowed paths
    def allowed_shm_dir(self, shm_dir: str) -> str:
        """``shm_dir`` when it is ``/dev/shm`` or the shared-memory directory of a rank
        registered here, as an absolute path without symlinks.

        Raises:
            ValueError: any other directory (a caller-chosen path)."""
        with self.lock:
            allowed = {"/dev/shm"} | {r.shm_dir for r in self.regs.values()}
        if not isinstance(shm_dir, str) or shm_dir not in allowed \
                or os.path.realpath(shm_dir) != os.path.normpath(shm_dir):
            raise ValueError(f"flash persister of job {self.job!r}: shm_dir {shm_dir!r} is not "
                             f"allowed; allowed: {sorted(allowed)} (no symlinks)")
        return shm_dir

    def allowed_dir(self, directory: str) -> str:
        """``directory`` when it can be the checkpoint directory of a role of this
        job: an absolute, normalized path; where ranks registered here, one of theirs
        or a sibling (another role under the job's checkpoint folder). A node that
        only holds replicas (no rank of the job) cannot tell more; the directory is
        only hashed into buffer names and recorded, never opened.

        Raises:
            ValueError: any other path."""
        with self.lock:
            dirs = {r.dir for r in self.regs.values()}
        ok = isinstance(directory, str) and os.path.isabs(directory) \
            and os.path.normpath(directory) == directory \
            and (not dirs or directory in dirs
                 or os.path.dirname(directory) in {os.path.dirname(d) for d in dirs})
        if not ok:
            raise ValueError(f"flash persister of job {self.job!r}: checkpoint dir "
                             f"{directory!r} is not this job's; registered: {sorted(dirs)}")
        return directory
