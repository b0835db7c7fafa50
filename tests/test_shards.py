"""The shard service (dynamic data sharding) and its rank-side sampler, in one process:
the sampler calls the service directly instead of through the JobMaster actor."""

from __future__ import annotations

import pytest

from dlrover_core.master.shards import ShardRegistry, ShardService
from dlrover_core.runtime.sharding import ShardSampler


def sampler(svc: ShardService, rank: int, batch: int, **kw) -> ShardSampler:
    def call(method, *args):
        return getattr(svc, method)(*args)

    return ShardSampler(call, rank, batch, svc.size, **kw)


def test_leases_cover_the_data_once_and_faster_ranks_lease_more():
    svc = ShardService(num_samples=100, shard_size=8)
    fast, slow = sampler(svc, 0, 4), sampler(svc, 1, 4)
    seen, step = [], 0
    while True:
        a = fast.next_indices()
        b = fast.next_indices()
        c = slow.next_indices() if step % 3 == 0 else []
        if a is None and b is None and c is None:
            break
        for x in (a, b, c):
            seen += x or []
        fast.step_done(step)
        slow.step_done(step)
        step += 1
    assert sorted(seen) == list(range(100))
    ledger = svc.ledger()
    assert ledger["samples_lost"] == 0 and ledger["samples_duplicated"] == 0
    assert ledger["samples_trained"] == 100
    assert fast.leases > 2 * slow.leases  # the faster rank leased more shards
    assert svc.done()


def test_restore_requeues_the_rolled_back_window_and_a_failed_ranks_lease():
    svc = ShardService(num_samples=64, shard_size=8)
    r0, r1 = sampler(svc, 0, 4), sampler(svc, 1, 4)
    for step in range(5):  # each rank reads one batch of 4 per step
        r0.next_indices()
        r1.next_indices()
        r0.step_done(step)
        r1.step_done(step)
    # checkpoint at step 2; rank 1 dies during step 5 holding a half-read shard
    r1.next_indices()
    gen = svc.restore(2)
    assert gen == 1
    survivor = sampler(svc, 0, 4)
    survivor.generation = gen
    assert r1.next_indices() is None  # a stale generation gets no lease
    got = []
    step = 3
    while (idx := survivor.next_indices()) is not None:
        got += idx
        survivor.step_done(step)
        step += 1
    ledger = svc.ledger()
    assert ledger["samples_lost"] == 0
    # steps 3 and 4 (2 ranks x 4 samples each) were rolled back and read again
    assert ledger["samples_duplicated"] == 16
    assert ledger["samples_trained"] == 64
    assert svc.done()
    # first the tails of the two shards read half by step 2 (16-19 and 24-27 read)
    assert got[:8] == [20, 21, 22, 23, 28, 29, 30, 31]


def test_epochs_files_and_shuffle():
    svc = ShardService(files=["a", "b", "c"], shard_size=2, num_epochs=2)
    assert svc.total == 6
    lease = svc.lease(0, 0)
    assert lease["files"] == ["a", "b"]
    s = ShardService(num_samples=10, shard_size=5, num_epochs=2)
    sm = sampler(s, 0, 5, shuffle=True, seed=3)
    first, second = sm.next_indices(), sm.next_indices()
    third, fourth = sm.next_indices(), sm.next_indices()
    assert sorted(first + second) == list(range(10)) == sorted(third + fourth)
    assert first + second != third + fourth  # a new permutation per epoch


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="shard_size=0"):
        ShardService(num_samples=10, shard_size=0)
    with pytest.raises(ValueError, match="num_samples=0"):
        ShardService(num_samples=0, shard_size=2)
    reg = ShardRegistry()
    assert reg.open("trainer", {"num_samples": 10, "shard_size": 2}) == 10
    with pytest.raises(ValueError, match="opened with"):
        reg.open("trainer", {"num_samples": 12, "shard_size": 2})
    with pytest.raises(KeyError, match="'critic' has no shard service"):
        reg.get("critic")


def test_elastic_dataloader_reads_through_the_shard_service():
    import torch

    from dlrover_core.tuning.dataloader import ElasticDataLoader

    data = torch.arange(20, dtype=torch.float32).unsqueeze(1)
    svc = ShardService(num_samples=20, shard_size=6)
    loader = ElasticDataLoader(data, batch_size=4, shuffle=False, shards=sampler(svc, 0, 4))
    got = []
    with pytest.raises(StopIteration):
        while True:
            got += loader.next_batch().squeeze(1).int().tolist()
    assert got == list(range(20))
    assert svc.leases_per_rank[0] == 4
