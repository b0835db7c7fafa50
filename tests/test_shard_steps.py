"""Every rank makes the same number of optimizer steps at the end of the data, whatever
``batches_per_shard`` and whatever resize happened (``ShardSampler.next_step``).

A pure-Python simulation of the ranks of a role over one ``ShardService``: each rank is a
thread with its own ``ShardSampler`` (the collective of ``next_step`` is a barrier
between the threads instead of a process group), the role trains in lock-step, saves
the shard state every ``EVERY`` steps, and is resized at a step near the end of the data:
the service restores to the newest checkpoint and the new ranks go on from it.

With ranks that each read their ``k`` micro-batches by ``next_indices`` (the loop the
elastic workload had), a 3 -> 2 shrink with ``batches_per_shard`` 2 leaves 3 micro-batches
on one rank and 2 on the other at the last step: one rank stops while the other enters
the gradient all-reduce alone (a hang). ``test_per_rank_reads_end_unequal`` keeps that
reproduction; the ``next_step`` tests fail on the old sampler (no ``next_step``)."""

from __future__ import annotations

import collections
import threading

import pytest

from dlrover_core.master.shards import ShardService
from dlrover_core.runtime.sharding import ShardSampler

G, B, STEPS, EVERY = 12, 2, 10, 3  # 12 samples per step: micro-batches of 2 at 1, 2, 3 ranks


class _Gather:
    """``all_gather_object`` between threads (one per rank)."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=10)
        self.slots: list = [None] * world

    def rank(self, r: int):
        def gather(obj):
            self.slots[r] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


def _sampler(svc: ShardService, rank: int, k: int | None = None, gather=None) -> ShardSampler:
    return ShardSampler(lambda m, *a: getattr(svc, m)(*a), rank, B, svc.size,
                        micro_batches=k, gather=gather)


def _merge(parts: list[dict]) -> dict:
    read: dict[int, int] = {}
    for part in parts:
        for sid, hi in part.items():
            read[sid] = max(read.get(sid, 0), hi)
    return {str(k): v for k, v in sorted(read.items())}


def run_role(bps: int, sizes: list[tuple[int, int]], num_samples: int = G * STEPS) -> dict:
    """Train over the data with the world sizes ``sizes`` (``(world, from step)``; a resize
    at that step restores the newest checkpoint first). Returns per phase the steps each
    rank made and its sample ids, the ledger, and the final history's ids."""
    svc = ShardService(num_samples=num_samples, shard_size=bps * B)
    ckpt = {"step": 0, "read": {}}
    phases = []
    start = 0
    for i, (world, at) in enumerate(sizes):
        if i:
            gen = svc.restore(ckpt["step"] - 1, {"size": svc.size, "read": ckpt["read"]})
            start = ckpt["step"]
        else:
            gen = {"generation": 0, "read": {}}
        stop = sizes[i + 1][1] if i + 1 < len(sizes) else None
        k = G // (B * world)
        gather = _Gather(world)
        out = {r: {"steps": [], "ids": {}} for r in range(world)}
        errors: list = []

        def rank_loop(r: int) -> None:
            try:
                s = _sampler(svc, r, k, gather.rank(r))
                s.generation = gen["generation"]
                s._trained = {int(a): b for a, b in gen["read"].items()}
                step = start
                while stop is None or step < stop:
                    micro = s.next_step()
                    if micro is None:
                        break
                    assert len(micro) == k and all(len(m) == B for m in micro)
                    s.step_done(step)
                    out[r]["steps"].append(step)
                    out[r]["ids"][step] = [x for m in micro for x in m]
                    step += 1
                    if step % EVERY == 0:  # a checkpoint: the shard state of every rank
                        read = _merge(gather.rank(r)(dict(s._trained)))
                        if r == 0:
                            ckpt.update(step=step, read=read)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
                gather.barrier.abort()

        threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        phases.append({"world": world, "start": start, "ranks": out})
    final: collections.Counter = collections.Counter()
    for i, ph in enumerate(phases):  # steps rolled back by the next phase's restore
        nxt = phases[i + 1]["start"] if i + 1 < len(phases) else None
        for rank in ph["ranks"].values():
            for step, ids in rank["ids"].items():
                if nxt is None or step < nxt:
                    final.update(ids)
    return {"phases": phases, "ledger": svc.ledger(), "final": final}


def _old_loop(bps: int, sizes: list[tuple[int, int]]) -> list[int]:
    """The per-rank loop (``k`` x ``next_indices``, stop when short), in lock-step; the
    micro-batches each rank got at the step where one came up short."""
    svc = ShardService(num_samples=G * STEPS, shard_size=bps * B)
    step, ckpt = 0, {"step": 0, "read": {}}
    for i, (world, at) in enumerate(sizes):
        if i:
            gen = svc.restore(ckpt["step"] - 1, {"size": svc.size, "read": ckpt["read"]})
            step = ckpt["step"]
        else:
            gen = {"generation": 0, "read": {}}
        stop = sizes[i + 1][1] if i + 1 < len(sizes) else STEPS + 1
        ranks = [_sampler(svc, r) for r in range(world)]
        for s in ranks:
            s.generation = gen["generation"]
        k = G // (B * world)
        while step < stop:
            got = [sum(s.next_indices() is not None for _ in range(k)) for s in ranks]
            if min(got) < k:
                return got
            for s in ranks:
                s.step_done(step)
            step += 1
            if step % EVERY == 0:
                ckpt = {"step": step, "read": _merge([s._trained for s in ranks])}
    return []


def test_per_rank_reads_end_unequal():
    """The reproduction: 3 -> 2 ranks at step 4, batches_per_shard 2: 3 and 2 micro-batches."""
    assert _old_loop(2, [(3, 0), (2, 4)]) == [3, 2]
    assert _old_loop(4, [(2, 0), (3, 7)]) == [2, 0, 2]  # a grow near the end too
    assert len(set(_old_loop(1, [(3, 0), (2, 4)]))) == 1  # batches_per_shard 1 hides it


@pytest.mark.parametrize("bps", [1, 2, 4])
@pytest.mark.parametrize("sizes", [
    [(3, 0)],                      # no resize
    [(3, 0), (2, 4)],              # the shrink of the reproduction
    [(3, 0), (2, 8)],              # a shrink near the end of the data
    [(2, 0), (3, 7)],              # a grow near the end of the data
    [(3, 0), (2, 5), (3, 8)],      # both
], ids=["fixed", "shrink4", "shrink8", "grow7", "shrink-grow"])
def test_next_step_gives_every_rank_the_same_steps_and_each_sample_once(bps, sizes):
    res = run_role(bps, sizes)
    for ph in res["phases"]:
        steps = {r: v["steps"] for r, v in ph["ranks"].items()}
        assert len({tuple(v) for v in steps.values()}) == 1, (ph["world"], steps)
    last = res["phases"][-1]["ranks"][0]["steps"]
    assert last[-1] == STEPS - 1  # the data set is 10 global batches: 10 steps in all
    assert sorted(res["final"]) == list(range(G * STEPS))  # every sample in the model...
    assert set(res["final"].values()) == {1}               # ...once
    ledger = res["ledger"]
    assert ledger["samples_lost"] == 0 and ledger["samples_duplicated"] == 0
    assert ledger["samples_trained"] == G * STEPS


def test_a_tail_smaller_than_a_global_batch_ends_every_rank_together():
    # 10 global batches and 5 samples more: not one more step of 12; every rank stops
    res = run_role(2, [(3, 0), (2, 4)], num_samples=G * STEPS + 5)
    steps = {r: v["steps"] for r, v in res["phases"][-1]["ranks"].items()}
    assert steps[0] == steps[1] and steps[0][-1] == STEPS - 1
    ledger = res["ledger"]
    assert ledger["samples_trained"] == G * STEPS
    assert ledger["samples_not_trained"] == 5 and ledger["samples_lost"] == 0


def test_next_step_without_micro_batches_or_a_process_group_is_named():
    svc = ShardService(num_samples=8, shard_size=4)
    with pytest.raises(ValueError, match="micro_batches"):
        _sampler(svc, 0).next_step()
    with pytest.raises(RuntimeError, match="rank 1 of 1: it needs the role's process group"):
        _sampler(svc, 1, k=1).next_step()
    one = ShardService(num_samples=8, shard_size=4)
    assert _sampler(one, 0, k=2).next_step() == [[0, 1], [2, 3]]  # one rank: no group
