"""The committer of the per-node persister (:class:`Committer`), in the persister
actor's process: commit a step whose ranks' files are all written
(:func:`.storage.try_commit`: the manifest, the rename, ``latest``, the prune to
``keep``), finish a commit that a crash interrupted, and mark the saves a commit
made obsolete as persisted (``persisted_seq``). Imports no torch.

It owns the set of checkpoint directories it is committing to now (a ``flush``
waits for it to empty) and writes ``persisted_seq`` into the slots' headers; the
files, the commit lock and the lineage are :mod:`.storage`'s. It runs in the
``flash-persister`` thread (:class:`.persisting.PersistLoop`), under the lock of the
:class:`.node_ranks.NodeRanks` for its bookkeeping, never for the disk writes.
"""

from __future__ import annotations

from typing import Callable

from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import shm, storage
from dlrover_plugin_flashckpt.failures import PersistFailures
from dlrover_plugin_flashckpt.node_ranks import NodeRanks
from dlrover_plugin_flashckpt.registration import Registration, save_attempt

declare("flash.persist.committed", "state", "persist",
        "the persister marked a save persisted: its step (or a newer one) is committed")


class Committer:
    """Commits the steps written on this node (see the module docstring).

    Args:
        ranks: the node's registrations and buffers.
        failures: the persister's failure state (a failed commit backs off).
        failed: records a failure ``(what, exc, where=(dir, step))``.
        landed: called ``(role, step)`` under the lock once ``step`` (or a newer one)
            is committed.
    """

    def __init__(self, ranks: NodeRanks, failures: PersistFailures,
                 failed: Callable[..., None], landed: Callable[[str, int], None]) -> None:
        self.ranks, self.failures = ranks, failures
        self._failed, self._landed = failed, landed
        #: checkpoint directories a step is being committed to now
        self.committing: set[str] = set()

    def is_committing(self, directory: str) -> bool:
        with self.ranks.lock:
            return directory in self.committing

    def retire(self, regs: list[Registration], lineage: dict | None,
               newest: int | None) -> None:
        """Mark the saves that ``(lineage, newest)`` (:func:`.storage.newest_with_lineage`,
        read before the headers) makes obsolete as persisted (:func:`.storage.obsolete`):
        their step is on disk, or they will never be written, and a save must not keep
        them as "waiting for the disk"."""
        if newest is None:
            return
        for r in regs:
            for path in r.slots:
                seg = self.ranks.seg(path)
                if seg is None:
                    continue
                h = seg.read_header()
                if h.state != shm.READY or h.persisted_seq == h.seq or h.step > newest:
                    continue
                with seg.locked():
                    h = seg.read_header()
                    if h.state == shm.READY and h.persisted_seq != h.seq and storage.obsolete(
                            lineage, newest, h.step, save_attempt(seg.meta_bytes(h), r),
                            h.saved_at):
                        h.persisted_seq = h.seq
                        seg.write_header(h)
                        crashpoint("flash.persist.committed", path=seg.path)

    def commit(self, role: str, step: int, reg: Registration,
               attempt: dict | None) -> bool | None:
        """Try the commit of ``step`` (``attempt``'s files, or an interrupted commit);
        True when it landed now, False when it cannot yet (ranks missing, another
        committer), ``None`` when it failed (recorded, backing off)."""
        with self.ranks.lock:  # a flush waits for the rename, ``latest`` and the prune
            self.committing.add(reg.dir)
        try:
            storage.finish_tail(reg.dir, reg.keep)
            committed = storage.try_commit(reg.dir, step, reg.world_size, reg.keep,
                                           attempt=attempt, markers=attempt is not None)
        except Exception as exc:  # noqa: BLE001
            self._failed(f"committing {role} step {step}", exc, where=(reg.dir, step))
            return None
        finally:
            with self.ranks.lock:
                self.committing.discard(reg.dir)
        lineage, newest = storage.newest_with_lineage(reg.dir)
        if newest is not None and newest >= step:
            self.failures.succeeded()
            with self.ranks.lock:
                self._landed(role, step)
                self.retire(self.ranks.of_role(role), lineage, newest)
        return committed

    def candidates(self) -> list[tuple[str, int, Registration, dict | None]]:
        """Steps newer than the newest commit whose local files are all written, and
        temp directories holding an interrupted commit's intent; newest first."""
        out = []
        for role in self.ranks.roles():
            regs = self.ranks.of_role(role)
            newest = storage.newest_committed(regs[0].dir)
            found: dict[int, dict | None] = {}
            for step in sorted(self.ranks.common_steps(regs), reverse=True):
                if (newest is None or step > newest) and self.ranks.pending(regs, step) == []:
                    seg, h = self.ranks.rank_steps(regs[0], pending_only=False)[step]
                    found[step] = save_attempt(seg.meta_bytes(h), regs[0])
            for step in storage.pending_tmp_steps(regs[0].dir):  # an intent: finish it
                if (newest is None or step > newest) and step not in found and \
                        storage.read_intent(storage.tmp_dir(regs[0].dir, step)) is not None:
                    found[step] = None
            if not found and storage.tail_pending(regs[0].dir, newest):
                found[newest] = None  # a crash stopped a commit after its move
            out += [(role, s, regs[0], found[s]) for s in sorted(found, reverse=True)]
        return out

    def check_recovered(self) -> None:
        """End the failing state when the step that failed is committed now."""
        failing = self.failures.state()
        if failing is None or failing.get("dir") is None:
            return
        newest = storage.newest_committed(failing["dir"])
        if newest is not None and newest >= failing["step"]:
            self.failures.succeeded()
