"""``ShardSampler``: a rank's side of the master's shard service (dynamic data sharding,
:mod:`dlrover_core.master.shards`).

A workload asks for sample indices batch by batch; the sampler leases shards of a few
batches from the JobMaster as it needs them, and after each optimizer step tells the
master which positions that step trained (one non-blocking call per step). After a
checkpoint load, :meth:`ShardSampler.restore` rolls the service back to the loaded
step, so a restart or a resize neither loses nor repeats a sample beyond the steps
after that checkpoint. Example (inside a workload's ``run()``)::

    sampler = ShardSampler.for_workload(self, num_samples=len(ds), batch_size=8)
    step = self.checkpointer.load(model=model) or -1
    sampler.restore(step)
    for step in range(step + 1, max_steps):
        idx = sampler.next_indices()          # None: the data set is done
        ...
        sampler.step_done(step)
"""

from __future__ import annotations

from typing import Any, Callable


class ShardSampler:
    """Leases shards and hands out batches of sample indices (or file names).

    Args:
        call: ``call(method, *args)`` runs a method of the role's shard service (on the
            JobMaster: ``shards_<method>(role, ...)``) and returns its result.
        rank: this rank. batch_size: samples per batch.
        size: the data set size (positions map to sample ``position % size``).
        shuffle, seed: a fresh permutation of the samples per epoch (torch ``randperm``
            seeded by ``seed * 1_000_003 + epoch``), the same on every rank.

    Raises:
        ValueError: ``batch_size < 1``.
    """

    def __init__(self, call: Callable[..., Any], rank: int, batch_size: int, size: int,
                 shuffle: bool = False, seed: int = 0) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size={batch_size!r}; allowed: an integer >= 1")
        self._call = call
        self.rank, self.batch_size, self.size = rank, int(batch_size), int(size)
        self.shuffle, self.seed = shuffle, seed
        self.generation = 0
        self._lease: dict | None = None  # the current shard, "start" moved as it is read
        self._spans: list[tuple[int, int, int]] = []  # read since the last step_done
        self._perms: dict[int, list[int]] = {}
        self.leases = 0

    @classmethod
    def for_workload(cls, workload: Any, batch_size: int, num_samples: int = 0,
                     files: list[str] | None = None, batches_per_shard: int = 4,
                     num_epochs: int = 1, shuffle: bool = False, seed: int = 0) -> ShardSampler:
        """The sampler of ``workload``'s rank over the shard service of its role, opened on
        the JobMaster with these settings (the first rank's settings win; a rank with
        other settings gets a ``ValueError``). Shards are ``batches_per_shard *
        batch_size`` positions."""
        import ray

        master, role = workload.master_handle, workload.role
        config = {"num_samples": int(num_samples), "files": list(files) if files else None,
                  "shard_size": int(batches_per_shard) * int(batch_size),
                  "num_epochs": int(num_epochs)}
        size = ray.get(master.shards_open.remote(role, config))

        def call(method: str, *args: Any) -> Any:
            fn = getattr(master, f"shards_{method}")
            if method == "report":
                return fn.remote(role, *args)  # fire and forget, in order per rank
            return ray.get(fn.remote(role, *args))

        return cls(call, workload.rank, batch_size, size, shuffle, seed)

    # ------------------------------------------------------------------ restore
    def restore(self, step: int) -> int:
        """Roll the role's shard service back to optimizer ``step`` (the loaded
        checkpoint; -1: none). Rank 0 does it and the generation goes to the others over
        the default process group (a collective: call it on every rank, after every rank
        loaded the same step). Returns the generation."""
        import torch.distributed as dist

        gen = [self._call("restore", int(step)) if self.rank == 0 else 0]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(gen, src=0)
        elif self.rank != 0:
            raise RuntimeError("ShardSampler.restore on rank > 0 needs the role's process group")
        self.generation = int(gen[0])
        self._lease, self._spans = None, []
        return self.generation

    # ------------------------------------------------------------------ batches
    def next_positions(self) -> list[int] | None:
        """Positions of the next batch (``batch_size`` of them, fewer at the very end, read
        across shard boundaries), or ``None`` when no shard is left to lease."""
        out: list[int] = []
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
            self._spans.append((ls["shard"], lo, hi))
            ls["start"] = hi
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

    def step_done(self, step: int) -> None:
        """Report what this rank read since the last call as trained in optimizer
        ``step`` (non-blocking). Call it after ``optimizer.step()``."""
        if self._spans:
            self._call("report", self.generation, self.rank, int(step), list(self._spans))
            self._spans = []
