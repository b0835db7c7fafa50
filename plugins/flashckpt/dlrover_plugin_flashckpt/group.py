"""How the ranks of one role agree, for :class:`.saver.FlashSaver`: the gather
(:class:`RankGroup`) and the attempt that names every save (:class:`Attempts`).

:class:`RankGroup` owns the handle of the role's gather board (a Ray actor,
:mod:`.agreement`, used by ranks without a torch.distributed group) and the round
number of its gathers. :class:`Attempts` owns this incarnation's attempt token
(:func:`.storage.make_attempt`): drawn and agreed at a load, written as the lineage
of the checkpoint directory by rank 0 at the first save after it. Both run in the
training thread (a load, the first save of an attempt), collectively on every rank.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import storage

log = logging.getLogger("dlrover_plugin_flashckpt.saver")

declare("flash.save.lineage_write", "io", "save",
        "rank 0's first save of an attempt writes lineage.json (attempt and base)")

#: seconds a rank without a process group waits for the others at a load's gather
GATHER_TIMEOUT_S = 60.0


class RankGroup:
    """The ranks of one role (see the module docstring).

    Args:
        job, directory: name the gather board (one per job and checkpoint directory).
        rank, world_size: this rank.
        distributed: whether a torch.distributed group may be up (then it gathers).
    """

    def __init__(self, job: str, directory: str, rank: int, world_size: int,
                 distributed: bool) -> None:
        self.job, self.dir = job, directory
        self.rank, self.world_size = rank, world_size
        self.distributed = distributed
        self._board: Any = None
        self._round = 0

    def dist(self) -> Any:
        """``torch.distributed`` when its group is up (and ``distributed``), else None."""
        if not self.distributed:
            return None
        import torch.distributed as dist

        return dist if dist.is_available() and dist.is_initialized() else None

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank of the role, in rank order: ``all_gather_object`` with a
        process group, else through the role's gather board (:mod:`.agreement`), so
        ranks without a group still choose the same step at load. ``[obj]`` alone when
        this is the only rank, or when the board cannot be reached or the others do
        not post within ``GATHER_TIMEOUT_S`` (logged)."""
        dist = self.dist()
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
            self._round += 1
            got = ray.get(self._board.gather.remote(self._round, self.rank, obj,
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
                        self._round, GATHER_TIMEOUT_S)
            return [obj]
        return got

    def all_ok(self, err: BaseException | None) -> list[str]:
        """Errors of every rank, ``"rank <r>: <type>: <message>"`` (empty: all
        succeeded). Collective."""
        msg = None if err is None else f"rank {self.rank}: {type(err).__name__}: {err}"
        return [e for e in self.gather(msg) if e]


class Attempts:
    """This incarnation's attempt (see the module docstring).

    Args:
        group: the ranks that agree on it.
        run_id: returns the run id the attempt names.
    """

    def __init__(self, group: RankGroup, run_id: Callable[[], str]) -> None:
        self.group = group
        self._run_id = run_id
        #: the attempt every save names, set by the first save after a load
        self.current: dict | None = None
        #: ``(attempt, base step)`` agreed by the last load, not started yet
        self.next: tuple[dict, int | None] | None = None

    def agree(self, base: int | None) -> None:
        """Draw this incarnation's attempt: every rank draws a random epoch and all take
        rank 0's (:meth:`RankGroup.gather`), so an incarnation never shares an attempt
        with an earlier one of the same run and world size. When the gather fails (the
        board unreachable, a rank missing), each rank keeps its own epoch (logged): the
        ranks' attempts then differ, so none of their saves commits until a later load
        agrees; nothing mixed can. The first save makes the attempt the lineage of the
        directory with ``base`` (the step restored) as its base (:meth:`start`)."""
        g = self.group
        own = storage.make_attempt(self._run_id(), g.world_size, storage.new_epoch())
        got = g.gather(own)
        if len(got) == g.world_size and got[0] is not None:
            attempt = got[0]
        else:
            attempt = own
            log.warning("flash saver rank %d could not agree on an attempt with the other "
                        "ranks: it uses its own, so its saves are not committed until the "
                        "next load agrees", g.rank)
        self.current = None
        self.next = (attempt, base)

    def start(self) -> dict:
        """At the first save after a load (or the first save at all: collective then):
        rank 0 writes the lineage (:func:`.storage.start_lineage`) before the save's
        meta block names the attempt, so no marker of it can precede the lineage."""
        g = self.group
        if self.next is None:
            self.agree(storage.newest_committed(g.dir) if g.rank == 0 else None)
        assert self.next is not None
        attempt, base = self.next
        if g.rank == 0:
            crashpoint("flash.save.lineage_write")
            try:
                storage.start_lineage(g.dir, attempt, base)
            except OSError as exc:  # a full or failing checkpoint folder
                # the save goes on into memory; ``current`` stays unset, so the next save
                # writes the lineage again. Until then the folder's lineage is the one
                # before, in which this attempt's steps (above its base) do not count:
                # none of them is committed, nothing mixed can be.
                log.warning("flash saver: the lineage of %s could not be written (%s); the "
                            "save stays in memory and the next one tries again", g.dir, exc)
                return attempt
        self.current, self.next = attempt, None
        return attempt
