"""The ledger counts samples trained and committed, not handed out (in one process: the
sampler calls the service directly). A rank that read ahead 3 batches and trained 1
reported 12 samples as trained, and its checkpoint's shard state held all 12, so a
restore never read samples 4-11 again while the ledger said nothing was lost."""

from __future__ import annotations

import json

from dlrover_core.master.shards import ShardRegistry, ShardService
from dlrover_core.runtime.sharding import ShardSampler


def _sampler(svc: ShardService, **kw) -> ShardSampler:
    return ShardSampler(lambda m, *a: getattr(svc, m)(*a), 0, 4, svc.size, **kw)


def test_read_ahead_is_not_trained_and_a_restore_reads_it_again():
    svc = ShardService(num_samples=32, shard_size=16)
    s = _sampler(svc, micro_batches=1)  # one micro-batch per optimizer step
    for _ in range(3):  # a loader read 3 batches ahead...
        s.next_indices()
    s.step_done(0)      # ...and step 0 trained the first
    ledger = svc.ledger(committed_step=1)
    assert ledger["samples_trained"] == 4 and ledger["samples_committed"] == 4
    assert svc.ledger(committed_step=0)["samples_committed"] == 0
    state = json.loads(s.state_dict()["shard_state"])
    assert state["read"] == {"0": 4}  # the checkpoint holds what was trained, no more
    s.step_done(1)  # step 1 trains the second read-ahead batch (4..7)
    assert svc.ledger(committed_step=1)["samples_trained"] == 8
    assert svc.ledger(committed_step=1)["samples_committed"] == 4  # step 1 not in it
    # restore the checkpoint of step 0: step 1's samples were rolled back (re-read), and
    # 4..15 are read again, not taken as trained
    gen = svc.restore(0, state)["generation"]
    again = _sampler(svc, micro_batches=1)
    again.generation = gen
    assert again.next_indices() == [4, 5, 6, 7]
    again.step_done(1)
    ledger = svc.ledger(committed_step=1)
    assert ledger["samples_reread_after_rollback"] == 4
    assert ledger["samples_trained"] == 8 and ledger["samples_duplicated"] == 0
    # the job ends here: 8..15 are under the open lease, never trained; 16..31 never
    # handed out; nothing lost
    assert ledger["samples_leased_not_trained"] == 8
    assert ledger["samples_not_trained"] == 24
    assert ledger["samples_lost"] == 0


def test_a_restore_that_is_never_read_again_leaves_samples_not_trained():
    svc = ShardService(num_samples=16, shard_size=8)
    s = _sampler(svc)
    for step in range(4):
        s.next_indices()
        s.step_done(step)
    svc.restore(1, {"size": 16, "read": {"0": 8}})  # steps 2 and 3 rolled back
    ledger = svc.ledger(committed_step=2)
    assert ledger["samples_reread_after_rollback"] == 8
    assert ledger["samples_trained"] == ledger["samples_committed"] == 8
    assert ledger["samples_not_trained"] == 8 and ledger["samples_lost"] == 0


def test_registry_sums_the_new_counts_and_takes_each_roles_checkpoint():
    reg = ShardRegistry()
    reg.open("a", {"num_samples": 8, "files": None, "shard_size": 4, "num_epochs": 1})
    svc = reg.get("a")
    lease = svc.lease(0, 0)
    svc.report(0, 0, 0, [(lease["shard"], 0, 4)])
    out = reg.ledger({"a": 1})
    assert out["roles"]["a"]["samples_committed"] == 4
    assert out["samples_not_trained"] == 4 and out["samples_leased_not_trained"] == 0
    assert reg.ledger()["roles"]["a"]["samples_committed"] is None
