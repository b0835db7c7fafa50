"""The shard service: dynamic data sharding owned by the JobMaster (DLRover's dynamic
sharding, seed ``003``).

The data set is an index range ``[0, num_samples)`` or a list of files (one sample id per
file); ``num_epochs`` passes over it give the *positions* ``[0, num_epochs * size)``,
position ``p`` being sample ``p % size`` of epoch ``p // size``. The positions are cut
into shards of ``shard_size`` positions (a few batches). Ranks **lease** shards from a
FIFO queue (a rank that finishes its shards sooner leases more) and **report** which
positions they trained at which optimizer step. A shard is read in order, so what the
model has trained of it is a prefix ``[start, read)``.

**Shard state in the checkpoint.** The ranks keep the same prefixes (the *shard state*,
``{"size", "read": {shard: read}}``, :meth:`ShardSampler.state_dict
<dlrover_core.runtime.sharding.ShardSampler.state_dict>`) and save it with the model. A
**restore** with the loaded state (:meth:`ShardService.restore`) sets every shard's
prefix to it, drops every lease, marks every report outside the prefixes as *rolled
back* (its gradient is not in the restored model), records positions inside them that
no report named (a report lost with a killed rank) as trained by rank -1 (the
checkpoint), and queues again what is left (the
unread tails of partly read shards first, then the untouched shards in order). So the
positions after the checkpoint are trained again exactly once, whichever reports reached
the master. Without a state (a workload that does not save it) the service rolls back
the reports of steps after the restored step instead.

The ledger (:meth:`ShardService.ledger`) counts per position, over the reports (what the
ranks' ``step_done`` reported as trained, never what was only handed out):
``samples_trained`` / ``samples_committed`` = positions in kept reports / of steps in
the newest checkpoint; ``samples_duplicated`` = kept (not rolled back) reports of a
position beyond its first: samples whose gradient is in the final model more than once
(0 when every restore had the checkpoint's shard state; a restore by step alone can
repeat the reports a killed rank never delivered, up to a checkpoint window);
``samples_reread_after_rollback`` = positions of rolled-back reports: training undone by
a restore and done again (work lost, not duplicates); ``samples_lost`` = positions handed
out in a lease that are neither in a kept report, nor back in the queue, nor under a
current lease; ``samples_leased_not_trained`` = positions under a lease open now and not
trained (at the job's end: handed out, never trained).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class Shard:
    """Positions ``[start, end)``; ``read``: the first position not yet trained in the
    kept history (``start <= read <= end``)."""

    id: int
    start: int
    end: int
    read: int = -1

    def __post_init__(self) -> None:
        if self.read < 0:
            self.read = self.start


class ShardService:
    """Leases, progress and restore of the shards of one role's data set (thread-safe).

    Args:
        num_samples: size of an index-range data set (or 0 with ``files``).
        shard_size: positions per shard (> 0), e.g. ``batches_per_shard * micro_batch``.
        files: a list of files instead of an index range (sample ``i`` is ``files[i]``).
        num_epochs: passes over the data set (>= 1).

    Raises:
        ValueError: a bad argument, named with its value.
    """

    def __init__(self, num_samples: int = 0, shard_size: int = 0,
                 files: list[str] | None = None, num_epochs: int = 1) -> None:
        size = len(files) if files else int(num_samples)
        if size <= 0:
            raise ValueError(f"sharding: num_samples={num_samples!r} with files={files!r}; "
                            "allowed: num_samples > 0 or a non-empty list of files")
        if int(shard_size) <= 0:
            raise ValueError(f"sharding.shard_size={shard_size!r}; allowed: an integer > 0")
        if int(num_epochs) < 1:
            raise ValueError(f"sharding.num_epochs={num_epochs!r}; allowed: an integer >= 1")
        self.size = size
        self.files = list(files) if files else None
        self.shard_size = int(shard_size)
        self.total = size * int(num_epochs)
        self._lock = threading.Lock()
        self.shards = {i: Shard(i, lo, min(lo + self.shard_size, self.total))
                       for i, lo in enumerate(range(0, self.total, self.shard_size))}
        self.queue: collections.deque[int] = collections.deque(self.shards)
        self.leases: dict[int, int] = {}  # shard id -> rank
        self.generation = 0
        self.handed_out: set[int] = set()  # shard ids ever leased
        # (generation, rank, step, shard id, lo, hi, rolled_back)
        self.reports: list[list[Any]] = []
        self.leases_per_rank: collections.Counter[int] = collections.Counter()

    # ------------------------------------------------------------------ ranks
    def lease(self, rank: int, generation: int) -> dict | None:
        """Lease the next shard to ``rank``: ``{"shard", "start", "end", "files"}`` (the
        unread positions ``[start, end)``; ``files``: their files, or ``None``), or
        ``None`` when the queue is empty (the data set is done, or the rest is leased).
        A lease of an older ``generation`` (before the last restore) gets ``None``."""
        with self._lock:
            if generation != self.generation or not self.queue:
                return None
            sid = self.queue.popleft()
            sh = self.shards[sid]
            self.leases[sid] = rank
            self.handed_out.add(sid)
            self.leases_per_rank[rank] += 1
            return {"shard": sid, "start": sh.read, "end": sh.end,
                    "files": self.file_names(sh.read, sh.end)}

    def report(self, generation: int, rank: int, step: int,
               spans: list[tuple[int, int, int]]) -> None:
        """``rank`` trained ``spans`` (``(shard, lo, hi)``: positions ``[lo, hi)`` of that
        shard, read in order) in optimizer ``step``. A report of an older generation
        arrives after a restore that rolled its step back: it is kept as rolled back."""
        with self._lock:
            stale = generation != self.generation
            for sid, lo, hi in spans:
                self.reports.append([generation, rank, int(step), int(sid), int(lo), int(hi),
                                     stale])
                if not stale:
                    sh = self.shards[int(sid)]
                    sh.read = max(sh.read, int(hi))
                    if sh.read >= sh.end:
                        self.leases.pop(sh.id, None)

    def restore(self, step: int, state: dict | None = None) -> dict:
        """Roll back to the checkpoint of optimizer ``step`` (-1: no checkpoint). With
        ``state`` (the checkpoint's shard state, ``{"size": int, "read": {shard id: first
        untrained position}}``; shards not named are untouched), each shard's trained
        prefix is the state's and every report outside it is rolled back; without it,
        the reports of steps after ``step`` are. Every lease is dropped and what is left
        is queued again. Returns ``{"generation", "read"}``: the new generation, which
        leases and reports must carry, and the restored state's ``read``.

        Raises:
            ValueError: ``state`` is of another data set, names an unknown shard or a
                position outside its shard.
        """
        with self._lock:
            read = self._check_state(state) if state is not None else None
            for sh in self.shards.values():
                sh.read = sh.start if read is None else read.get(sh.id, sh.start)
            for r in self.reports:
                if r[6]:
                    continue
                if read is None:
                    r[6] = r[2] > step
                else:
                    r[6] = r[5] > self.shards[r[3]].read
            if read is None:
                for r in self.reports:
                    if not r[6]:
                        sh = self.shards[r[3]]
                        sh.read = max(sh.read, r[5])
            else:
                self._credit_unreported(step)
            self.leases.clear()
            partial = [s.id for s in self.shards.values() if s.start < s.read < s.end]
            fresh = [s.id for s in self.shards.values() if s.read == s.start]
            self.queue = collections.deque(partial + fresh)
            self.generation += 1
            return {"generation": self.generation,
                    "read": {str(s.id): s.read for s in self.shards.values() if s.read > s.start}}

    def _credit_unreported(self, step: int) -> None:
        """Positions the restored state holds that no kept report names (a report a
        killed rank never delivered) are in the model: record them as trained at
        ``step`` by rank -1 (the checkpoint)."""
        covered: dict[int, set[int]] = collections.defaultdict(set)
        for r in self.reports:
            if not r[6]:
                covered[r[3]].update(range(r[4], r[5]))
        for sh in self.shards.values():
            missing = sorted(set(range(sh.start, sh.read)) - covered[sh.id])
            lo = 0
            for i in range(1, len(missing) + 1):
                if i == len(missing) or missing[i] != missing[i - 1] + 1:
                    self.reports.append([self.generation, -1, int(step), sh.id,
                                         missing[lo], missing[i - 1] + 1, False])
                    lo = i

    def _check_state(self, state: dict) -> dict[int, int]:
        if not isinstance(state, dict) or int(state.get("size", -1)) != self.size:
            raise ValueError(f"shard state {str(state)[:200]!r}: its data set size is not "
                             f"{self.size}; allowed: the state of this role's data set")
        read: dict[int, int] = {}
        for sid, pos in (state.get("read") or {}).items():
            sh = self.shards.get(int(sid))
            if sh is None or not sh.start <= int(pos) <= sh.end:
                raise ValueError(
                    f"shard state read[{sid!r}]={pos!r}: allowed: a shard id in "
                    f"0..{len(self.shards) - 1} and a position in its [start, end]"
                    + (f" = [{sh.start}, {sh.end}]" if sh is not None else ""))
            read[int(sid)] = int(pos)
        return read

    # ------------------------------------------------------------------ views
    def file_names(self, lo: int, hi: int) -> list[str] | None:
        if self.files is None:
            return None
        return [self.files[p % self.size] for p in range(lo, hi)]

    def done(self) -> bool:
        """Every position trained in the kept history."""
        with self._lock:
            return all(s.read >= s.end for s in self.shards.values())

    def ledger(self, committed_step: int | None = None) -> dict:
        """The per-sample ledger (see the module doc), over the reports:

        - ``samples_total``: positions (``num_samples x num_epochs``);
        - ``samples_trained``: distinct positions in kept reports (what ``step_done``
          reported as trained and no restore rolled back);
        - ``samples_committed``: those of steps below ``committed_step`` (checkpoint
          ``N`` holds steps ``0..N-1``; ``None`` when no checkpoint is known);
        - ``samples_duplicated``: kept reports of a position beyond its first;
        - ``samples_reread_after_rollback``: positions of rolled-back reports;
        - ``samples_lost``: handed out, not trained, and neither back in the queue nor
          under a lease open now;
        - ``samples_leased_not_trained``: under a lease open now and not trained (at the
          job's end: handed out and never trained, e.g. a tail smaller than a step);
        - ``samples_not_trained``: ``samples_total - samples_trained``;
        - ``leases_per_rank``, ``generation``.
        """
        with self._lock:
            kept: collections.Counter[int] = collections.Counter()
            committed: set[int] = set()
            rolled_back = 0
            for _, _, step, _, lo, hi, rolled in self.reports:
                if rolled:
                    rolled_back += hi - lo
                else:
                    kept.update(range(lo, hi))
                    if committed_step is not None and step < committed_step:
                        committed.update(range(lo, hi))
            in_queue, leased = set(), set()
            for sid in self.queue:
                sh = self.shards[sid]
                in_queue.update(range(sh.read, sh.end))
            for sid in self.leases:
                sh = self.shards[sid]
                leased.update(range(sh.read, sh.end))
            handed = set()
            for sid in self.handed_out:
                sh = self.shards[sid]
                handed.update(range(sh.start, sh.end))
            lost = handed - set(kept) - in_queue - leased
            return {"samples_total": self.total, "samples_trained": len(kept),
                    "samples_committed": None if committed_step is None else len(committed),
                    "samples_duplicated": sum(c - 1 for c in kept.values() if c > 1),
                    "samples_reread_after_rollback": rolled_back,
                    "samples_lost": len(lost),
                    "samples_leased_not_trained": len(leased - set(kept)),
                    "samples_not_trained": self.total - len(kept),
                    "leases_per_rank": {str(k): v for k, v in sorted(self.leases_per_rank.items())},
                    "generation": self.generation}


class ShardRegistry:
    """The JobMaster's shard services, one per role (made by the role's first
    ``open``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.services: dict[str, ShardService] = {}
        self._configs: dict[str, dict] = {}

    def open(self, role: str, config: dict) -> int:
        """The service of ``role`` with ``config`` (``num_samples``, ``files``,
        ``shard_size``, ``num_epochs``); returns the data set size.

        Raises:
            ValueError: a bad setting, or ``config`` differs from the one the role's
                service was opened with.
        """
        with self._lock:
            svc = self.services.get(role)
            if svc is None:
                svc = self.services[role] = ShardService(**config)
                self._configs[role] = dict(config)
            elif self._configs[role] != dict(config):
                raise ValueError(f"shard service of role {role!r} opened with {config!r}; "
                                f"it has {self._configs[role]!r}; allowed: the same settings "
                                "on every rank and restart")
            return svc.size

    def get(self, role: str) -> ShardService:
        """Raises ``KeyError`` naming the role when it has no shard service."""
        try:
            return self.services[role]
        except KeyError:
            raise KeyError(f"role {role!r} has no shard service; open it first "
                           "(ShardSampler.for_workload)") from None

    def ledger(self, committed: dict[str, int] | None = None) -> dict:
        """Per role (``roles``), :meth:`ShardService.ledger` with the role's newest
        checkpoint step from ``committed`` (role -> step); plus ``samples_lost``,
        ``samples_duplicated``, ``samples_reread_after_rollback``,
        ``samples_leased_not_trained`` and ``samples_not_trained`` summed over them."""
        committed = committed or {}
        roles = {role: svc.ledger(committed.get(role)) for role, svc in self.services.items()}
        return {key: sum(r[key] for r in roles.values()) for key in
                ("samples_lost", "samples_duplicated", "samples_reread_after_rollback",
                 "samples_leased_not_trained", "samples_not_trained")} | {"roles": roles}
