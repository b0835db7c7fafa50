"""``ShardSampler``: a rank's side of the master's shard service (dynamic data sharding,
:mod:`dlrover_core.master.shards`).

A workload asks for the sample indices of each optimizer step (:meth:`ShardSampler.next_step`:
the same number of micro-batches on every rank, a collective) or batch by batch
(:meth:`ShardSampler.next_indices`); the sampler leases shards of a few batches from the
JobMaster as it needs them, and after each optimizer step tells the master which
positions that step trained (one non-blocking call per step). The sampler
is also a checkpoint object: its :meth:`~ShardSampler.state_dict` (the trained prefix of
every shard) is saved with the model, and after a load :meth:`ShardSampler.restore`
rewinds the service to it, so the samples after the checkpoint are trained exactly once
in the final model. Example (inside a workload)::

    sampler = ShardSampler.for_workload(self, num_samples=len(ds))  # elastic.micro_batch
    extra = {"step": 0}
    loaded = self.checkpointer.load(model=model, extra=extra, shards=sampler)
    sampler.restore(extra["step"] - 1 if loaded is not None else -1)
    for step in range(extra["step"], max_steps):
        micro = sampler.next_step()           # None on every rank: the data set is done
        ...                                   # one micro-batch per list, then optimizer.step()
        sampler.step_done(step)
        extra["step"] = step + 1
        self.checkpointer.maybe_save(step + 1, model=model, extra=extra, shards=sampler)

A ``torchrun`` script run as a script role gets its sampler from
:meth:`ShardSampler.for_script` (the JobMaster found through the environment the role
gives the script) and its batches from :class:`ShardBatchSampler` (a
``torch.utils.data.Sampler`` of index batches for ``DataLoader(batch_sampler=...)``).
"""

from __future__ import annotations

import json
from typing import Any, Callable

# the JobMaster of a script role: found as every script API finds it (re-exported here)
from dlrover_core.runtime.shard_batches import (  # noqa: F401 - ShardBatchSampler re-exported
    ShardBatchSampler, _all_gather, _count, _spans)
from dlrover_core.script_api import SCRIPT_ENV, NotInDlroverError, script_master

__all__ = ["SCRIPT_ENV", "NotInDlroverError", "ShardBatchSampler", "ShardSampler"]


class ShardSampler:
    """Leases shards and hands out batches of sample indices (or file names).

    Args:
        call: ``call(method, *args)`` runs a method of the role's shard service (on the
            JobMaster: ``shards_<method>(role, ...)``) and returns its result.
        rank: this rank. batch_size: samples per batch.
        size: the data set size (positions map to sample ``position % size``).
        shuffle, seed: a fresh permutation of the samples per epoch (torch ``randperm``
            seeded by ``seed * 1_000_003 + epoch``), the same on every rank.
        wait: ``wait(results)`` waits for what ``call("report", ...)`` returned (Ray
            object refs: ``ray.get``); default: nothing to wait for.
        micro_batches: batches per optimizer step on this rank (the gradient
            accumulation steps); :meth:`next_step` hands out that many and
            :meth:`step_done` reports that many by default. ``None``: not known
            (``step_done`` then reports every batch handed out since its last call).
        gather: ``gather(obj)`` returns every rank's ``obj`` in rank order (the ranks of
            the role); default: ``torch.distributed.all_gather_object`` over the default
            process group when it is initialized, else ``[obj]``.

    Raises:
        ValueError: ``batch_size < 1`` or ``micro_batches < 1``.
    """

    def __init__(self, call: Callable[..., Any], rank: int, batch_size: int, size: int,
                 shuffle: bool = False, seed: int = 0,
                 wait: Callable[[list], Any] | None = None, micro_batches: int | None = None,
                 gather: Callable[[Any], list] | None = None) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size!r}; allowed: an integer >= 1")
        if micro_batches is not None and int(micro_batches) < 1:
            raise ValueError(f"micro_batches={micro_batches!r}; allowed: an integer >= 1 "
                             "or None")
        self.micro_batches = None if micro_batches is None else int(micro_batches)
        self._gather = gather or _all_gather
        self._held: list[tuple[int, int, int]] = []  # taken by next_step, not yet dealt
        self._call, self._wait = call, wait
        self.rank, self.batch_size, self.size = rank, int(batch_size), int(size)
        self.shuffle, self.seed = shuffle, seed
        self.generation = 0
        self._lease: dict | None = None  # the current shard, "start" moved as it is read
        self._batches: list[list[tuple[int, int, int]]] = []  # handed out, not reported
        self._trained: dict[int, int] = {}  # shard -> end of its trained prefix (this rank)
        self._inflight: list = []  # results of report calls not waited for
        self._perms: dict[int, list[int]] = {}
        self.loaded_state: dict | None = None  # from load_state_dict, for restore
        self.leases = 0

    @classmethod
    def for_workload(cls, workload: Any, batch_size: int = 0, num_samples: int = 0,
                     files: list[str] | None = None, batches_per_shard: int = 4,
                     num_epochs: int = 1, shuffle: bool = False, seed: int = 0,
                     micro_batches: int | None = None) -> ShardSampler:
        """The sampler of ``workload``'s rank over the shard service of its role, opened on
        the JobMaster with these settings (the first rank's settings win; a rank with
        other settings gets a ``ValueError``). Shards are ``batches_per_shard *
        batch_size`` positions. ``batch_size`` (0: the context's ``micro_batch``, from
        ``elastic.micro_batch``) and ``micro_batches`` (``None``: the context's
        ``grad_accum_steps`` when ``elastic.global_batch`` is set) default to what the
        job's spec says for this world size.

        Raises:
            ValueError: no ``batch_size`` given and the spec sets no
                ``elastic.micro_batch``.
        """
        ctx = getattr(workload, "context", None)
        batch_size = int(batch_size) or int(getattr(ctx, "micro_batch", 0) or 0)
        if batch_size < 1:
            raise ValueError("ShardSampler.for_workload: batch_size=0 and the job sets no "
                             "elastic.micro_batch; allowed: batch_size >= 1, or "
                             "elastic.global_batch and elastic.micro_batch in the spec")
        if micro_batches is None and ctx is not None and getattr(ctx, "global_batch", 0):
            micro_batches = ctx.grad_accum_steps
        return cls._over_master(workload.master_handle, workload.role, workload.rank,
                                batch_size, num_samples, files, batches_per_shard,
                                num_epochs, shuffle, seed, micro_batches)

    @classmethod
    def for_script(cls, batch_size: int = 0, num_samples: int = 0,
                   files: list[str] | None = None, batches_per_shard: int = 4,
                   num_epochs: int = 1, shuffle: bool = False,
                   seed: int = 0, micro_batches: int | None = None) -> ShardSampler:
        """:meth:`for_workload` for a script run as a script role: joins the job's Ray
        cluster (``ray.init(address=$RAY_ADDRESS)`` unless already joined) and finds the
        JobMaster of ``$DLROVER_JOB``; role ``$DLROVER_ROLE``, rank ``$RANK``
        (:func:`dlrover_core.script_api.script_master`). ``batch_size`` and
        ``micro_batches`` default to ``$DLROVER_MICRO_BATCH`` and
        ``$DLROVER_GRAD_ACCUM_STEPS`` (set when the spec has ``elastic.global_batch``).

        Raises:
            NotInDlroverError: one of :data:`SCRIPT_ENV` is not set (not a script role),
                naming the missing variables, or the job has no JobMaster.
            ValueError: no ``batch_size`` given and ``$DLROVER_MICRO_BATCH`` is not set.
        """
        import os

        sm = script_master("ShardSampler.for_script",
                           "outside dlrover, use a DistributedSampler")
        batch_size = int(batch_size) or int(os.environ.get("DLROVER_MICRO_BATCH", "0"))
        if batch_size < 1:
            raise ValueError("ShardSampler.for_script: batch_size=0 and DLROVER_MICRO_BATCH "
                             "is not set (the job sets no elastic.micro_batch); allowed: "
                             "batch_size >= 1")
        if micro_batches is None and os.environ.get("DLROVER_GRAD_ACCUM_STEPS"):
            micro_batches = int(os.environ["DLROVER_GRAD_ACCUM_STEPS"])
        return cls._over_master(sm.master, sm.role, sm.rank, batch_size, num_samples, files,
                                batches_per_shard, num_epochs, shuffle, seed, micro_batches)

    @classmethod
    def _over_master(cls, master: Any, role: str, rank: int, batch_size: int,
                     num_samples: int, files: list[str] | None, batches_per_shard: int,
                     num_epochs: int, shuffle: bool, seed: int,
                     micro_batches: int | None = None) -> ShardSampler:
        import ray

        config = {"num_samples": int(num_samples), "files": list(files) if files else None,
                  "shard_size": int(batches_per_shard) * int(batch_size),
                  "num_epochs": int(num_epochs)}
        size = ray.get(master.shards_open.remote(role, config))

        def call(method: str, *args: Any) -> Any:
            if method == "restore" and args[1] is not None:  # the checkpoint's state
                return ray.get(master.shards_restore_state.remote(role, *args))
            if method == "restore":  # no checkpoint state: by step
                return ray.get(master.shards_restore.remote(role, args[0]))
            fn = getattr(master, f"shards_{method}")
            if method == "report":
                return fn.remote(role, *args)  # waited for by flush()
            return ray.get(fn.remote(role, *args))

        return cls(call, rank, batch_size, size, shuffle, seed, wait=ray.get,
                   micro_batches=micro_batches)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """The shard state: ``{"shard_state": json}`` of ``{"size": int, "read": {shard
        id: end of its trained prefix}}`` over every rank, as of the last
        :meth:`step_done`. A collective over the default process group when it is
        initialized (call it on every rank: the checkpointer does, when it saves). It
        first waits until this rank's reports reached the master (:meth:`flush`), so
        the master's ledger holds every step the checkpoint holds."""
        import torch.distributed as dist

        self.flush()
        mine = dict(self._trained)
        parts = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        read: dict[int, int] = {}
        for part in parts:
            for sid, hi in (part or {}).items():
                read[int(sid)] = max(read.get(int(sid), 0), int(hi))
        state = {"size": self.size, "read": {str(k): v for k, v in sorted(read.items())}}
        return {"shard_state": json.dumps(state)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Keep a loaded :meth:`state_dict` for the next :meth:`restore`.

        Raises:
            ValueError: it is not a shard state of a data set of this size.
        """
        try:
            state = json.loads(state_dict["shard_state"])
            ok = int(state["size"]) == self.size and isinstance(state["read"], dict)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"shard state {str(state_dict)[:200]!r}: allowed: a "
                             f"ShardSampler.state_dict() of a data set of {self.size} samples")
        self.loaded_state = state

    def restore(self, step: int, state: dict | None = None) -> int:
        """Rewind the role's shard service to the loaded checkpoint of optimizer ``step``
        (-1: none): to ``state`` (default: the one :meth:`load_state_dict` got; ``{}``
        when ``step`` is -1), else, without one, by ``step``; every rank then holds the
        restored state (what the service restored to). Rank 0 does it and the
        generation goes to the others over the default process group (a collective:
        call it on every rank, after every rank loaded the same step). Returns the
        generation."""
        import torch.distributed as dist

        if state is None:
            state = self.loaded_state if step >= 0 else {"size": self.size, "read": {}}
        out = [self._call("restore", int(step), state) if self.rank == 0 else None]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(out, src=0)
        elif self.rank != 0:
            raise RuntimeError("ShardSampler.restore on rank > 0 needs the role's process group")
        self.generation = int(out[0]["generation"])
        self._lease, self._batches, self._held = None, [], []
        self._trained = {int(k): int(v) for k, v in out[0]["read"].items()}
        return self.generation

    # ------------------------------------------------------------------ batches
    def next_positions(self) -> list[int] | None:
        """Positions of the next batch (``batch_size`` of them, fewer at the very end, read
        across shard boundaries), or ``None`` when no shard is left to lease."""
        out: list[int] = []
        spans: list[tuple[int, int, int]] = []
        while len(out) < self.batch_size:
            if self._lease is None or self._lease["start"] >= self._lease["end"]:
                self._lease = self._call("lease", self.rank, self.generation)
                if self._lease is None:
                    break
                self.leases += 1
            ls = self._lease
            take = min(self.batch_size - len(out), ls["end"] - ls["start"])
            lo, hi = ls["start"], ls["start"] + take
            out.extend(range(lo, hi))
            spans.append((ls["shard"], lo, hi))
            ls["start"] = hi
        if spans:
            self._batches.append(spans)
        return out or None

    def next_indices(self) -> list[int] | None:
        """Data set indices of the next batch (see :meth:`next_positions`)."""
        pos = self.next_positions()
        return None if pos is None else [self.index(p) for p in pos]

    def index(self, position: int) -> int:
        """The data set index of ``position`` (after the epoch's permutation)."""
        epoch, i = divmod(position, self.size)
        if not self.shuffle:
            return i
        perm = self._perms.get(epoch)
        if perm is None:
            import torch

            g = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + epoch)
            perm = self._perms[epoch] = torch.randperm(self.size, generator=g).tolist()
        return perm[i]

    def next_step(self, micro_batches: int | None = None) -> list[list[int]] | None:
        """Data set indices of this rank's micro-batches for the next optimizer step:
        ``micro_batches`` (default: the sampler's) lists of ``batch_size`` indices, the
        same number on every rank; or ``None`` on every rank at once when what is left
        (in the queue and under every rank's leases) does not fill one more step of the
        whole role, ``micro_batches x batch_size x world_size`` samples (that tail is
        not trained; it is reported as not trained by the ledger). So every rank makes
        the same number of optimizer steps whatever the shard size and whatever resize
        happened.

        A collective (``gather``: over the default process group; call it on every rank
        at every step). Each rank first takes up to its share from its own lease and the
        queue; when some rank came up short (the shards left are under other ranks'
        leases), the ranks holding more take more, and the positions taken are dealt out
        again: rank ``r`` trains the ``r``-th share, in order. Report the step with
        :meth:`step_done`.

        Raises:
            ValueError: no ``micro_batches`` given and the sampler has none.
            RuntimeError: a rank above 0 without the role's process group.
        """
        k = micro_batches if micro_batches is not None else self.micro_batches
        if k is None or int(k) < 1:
            raise ValueError(f"next_step(micro_batches={micro_batches!r}): allowed: an "
                             "integer >= 1 (or a sampler made with micro_batches)")
        share = int(k) * self.batch_size
        have, self._held = self._held, []
        exhausted = self._take(share - _count(have), have)
        while True:
            rem = self._lease["end"] - self._lease["start"] if self._lease else 0
            infos = self._gather((_count(have), rem, exhausted, have))
            world = len(infos)
            if self.rank >= world:
                raise RuntimeError(f"ShardSampler.next_step on rank {self.rank} of {world}: "
                                   "it needs the role's process group (initialized on "
                                   "every rank)")
            total = sum(i[0] for i in infos)
            deficit = world * share - total
            if deficit <= 0:
                break
            extra = [0] * world  # who takes what is missing: leases first, then the queue
            for r, (_, r_rem, _, _) in enumerate(infos):
                extra[r] = min(r_rem, deficit - sum(extra))
            left = deficit - sum(extra)
            takers = [r for r, i in enumerate(infos) if not i[2]]
            if left > 0 and takers:
                extra[takers[0]] += left
            if not any(extra):  # nothing left anywhere: the data set is done
                self._held = have
                return None
            exhausted = self._take(extra[self.rank], have) or exhausted
        pool = [(sid, p) for i in infos for sid, lo, hi in i[3] for p in range(lo, hi)]
        mine = pool[self.rank * share:(self.rank + 1) * share]
        out = []
        for m in range(int(k)):
            part = mine[m * self.batch_size:(m + 1) * self.batch_size]
            self._batches.append(_spans(part))
            out.append([self.index(p) for _, p in part])
        return out

    def _take(self, n: int, have: list[tuple[int, int, int]]) -> bool:
        """Append up to ``n`` positions to ``have`` (spans), from this rank's lease, then
        new leases; True when the queue gave none (nothing left to lease)."""
        while n > 0:
            if self._lease is None or self._lease["start"] >= self._lease["end"]:
                self._lease = self._call("lease", self.rank, self.generation)
                if self._lease is None:
                    return True
                self.leases += 1
            ls = self._lease
            take = min(n, ls["end"] - ls["start"])
            have.append((ls["shard"], ls["start"], ls["start"] + take))
            ls["start"] += take
            n -= take
        return False

    def step_done(self, step: int, batches: int | None = None) -> None:
        """Report batches handed out as trained in optimizer ``step`` (non-blocking):
        the first ``batches`` not reported yet; by default the step's
        ``micro_batches`` when the sampler has them (batches read ahead, e.g. by a
        ``DataLoader``'s workers, stay for a later step), else every batch handed out
        since the last call. Call it after ``optimizer.step()``: only what it reports
        is trained for the ledger and the checkpoint's shard state.

        Raises:
            ValueError: ``batches`` is negative or more than were handed out.
        """
        if batches is None:
            n = len(self._batches) if self.micro_batches is None else \
                min(self.micro_batches, len(self._batches))
        else:
            n = int(batches)
        if not 0 <= n <= len(self._batches):
            raise ValueError(f"step_done(batches={batches!r}): allowed: 0.."
                             f"{len(self._batches)} (the batches handed out, not reported)")
        spans = [sp for b in self._batches[:n] for sp in b]
        del self._batches[:n]
        if not spans:
            return
        for sid, _, hi in spans:
            self._trained[sid] = max(self._trained.get(sid, 0), hi)
        result = self._call("report", self.generation, self.rank, int(step), spans)
        if result is not None and self._wait is not None:
            self._inflight.append(result)
            if len(self._inflight) > 64:
                self.flush()

    def flush(self) -> None:
        """Wait until every report sent so far reached the master."""
        if self._inflight and self._wait is not None:
            self._wait(self._inflight)
        self._inflight = []
