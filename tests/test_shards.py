"""The shard service (dynamic data sharding) and its rank-side sampler, in one process:
the sampler calls the service directly instead of through the JobMaster actor."""

from __future__ import annotations

import json

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
    gen = svc.restore(2)["generation"]
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
    # steps 3 and 4 (2 ranks x 4 samples each) were rolled back and read again: undone
    # work, not duplicates (no sample's gradient is kept twice)
    assert ledger["samples_reread_after_rollback"] == 16
    assert ledger["samples_duplicated"] == 0
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
    loader.shards.step_done(0)
    state = loader.state_dict()
    assert json.loads(state["shards"]["shard_state"])["read"] == {
        "0": 6, "1": 12, "2": 18, "3": 20}
    again = ElasticDataLoader(data, batch_size=4, shuffle=False, shards=sampler(svc, 0, 4))
    again.load_state_dict(state)
    again.shards.restore(0)
    with pytest.raises(StopIteration):  # the state says every sample is trained
        again.next_batch()
    # shards are read in the main process: a change has no transition to skip
    again.reconfigure(batch_size=2, num_workers=2)
    assert not again.refilling


def test_checkpointed_shard_state_rewinds_even_when_a_report_never_arrived():
    """The shard state saved with the checkpoint decides what is trained: rank 1's report
    of step 2 is lost (as a SIGKILL can drop a non-blocking call); restoring by step
    alone would queue those samples again and train them twice; the state does not."""
    svc = ShardService(num_samples=48, shard_size=4)
    r0, r1 = sampler(svc, 0, 4), sampler(svc, 1, 4)
    lost_report = []
    for step in range(5):
        r0.next_indices()
        lost_report += r1.next_indices()
        r0.step_done(step)
        if step == 2:  # the master never hears of rank 1's step 2
            r1._call, call = (lambda *a: None), r1._call
            r1.step_done(step)
            r1._call = call
        else:
            r1.step_done(step)
        if step == 2:  # the checkpoint of steps 0..2 (one state over both ranks)
            saved = r0.state_dict()
            other = r1.state_dict()
    by_step = ShardService(num_samples=48, shard_size=4)
    for r in svc.reports:
        by_step.reports.append(list(r))
    by_step.handed_out = set(svc.handed_out)
    merged = json.loads(saved["shard_state"])
    # each rank saves only its own prefixes here (no process group): merge them
    merged["read"].update(json.loads(other["shard_state"])["read"])
    fresh = sampler(svc, 0, 4)
    fresh.load_state_dict({"shard_state": json.dumps(merged)})
    out = fresh.restore(2)
    assert out == 1
    got = []
    while (idx := fresh.next_indices()) is not None:
        got += idx
        fresh.step_done(10)
    assert not set(got) & set(lost_report[8:12])  # step 2 of rank 1: in the checkpoint
    ledger = svc.ledger()
    assert ledger["samples_duplicated"] == 0
    assert ledger["samples_reread_after_rollback"] == 16  # steps 3, 4 of both ranks
    assert ledger["samples_lost"] == 0  # step 2 of rank 1: credited to the checkpoint
    assert ledger["samples_trained"] == 48
    assert [r[1:6] for r in svc.reports if r[1] == -1] == [[-1, 2, 5, 20, 24]]
    # the same history restored by step alone trains rank 1's step 2 twice
    assert by_step.restore(2)["read"] != svc.restore(2, merged)["read"]


def test_step_done_reports_only_trained_batches_and_bad_states_are_named():
    svc = ShardService(num_samples=16, shard_size=8)
    sm = sampler(svc, 0, 2)
    sm.next_indices()
    sm.next_indices()
    sm.next_indices()  # read ahead (a DataLoader worker's prefetch)
    sm.step_done(0, batches=2)
    assert json.loads(sm.state_dict()["shard_state"]) == {"size": 16, "read": {"0": 4}}
    with pytest.raises(ValueError, match=r"batches=5.*0\.\.1"):
        sm.step_done(1, batches=5)
    with pytest.raises(ValueError, match="data set of 16 samples"):
        sm.load_state_dict({"shard_state": json.dumps({"size": 17, "read": {}})})
    with pytest.raises(ValueError, match=r"read\['9'\]=3.*shard id in 0\.\.1"):
        svc.restore(0, {"size": 16, "read": {"9": 3}})
    with pytest.raises(ValueError, match=r"read\['1'\]=3.*\[8, 16\]"):
        svc.restore(0, {"size": 16, "read": {"1": 3}})


def test_batch_sampler_in_a_dataloader_and_the_error_outside_dlrover(monkeypatch):
    import torch
    from torch.utils.data import DataLoader

    from dlrover_core.runtime.sharding import NotInDlroverError, ShardBatchSampler

    svc = ShardService(num_samples=10, shard_size=4)
    sm = sampler(svc, 0, 3)
    data = torch.arange(10)
    got = []
    for step, batch in enumerate(DataLoader(data, batch_sampler=ShardBatchSampler(sm))):
        got += batch.tolist()
        sm.step_done(step)
    assert got == list(range(10))
    assert svc.ledger()["samples_trained"] == 10
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("RANK", "0")
    for key in ("DLROVER_JOB", "DLROVER_ROLE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(NotInDlroverError, match="DLROVER_JOB, DLROVER_ROLE not set"):
        ShardSampler.for_script(batch_size=4, num_samples=10)
