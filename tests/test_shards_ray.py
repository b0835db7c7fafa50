"""``ShardSampler.for_workload`` over a real Ray actor: the checkpoint's shard state
decides the restore (``shards_restore_state``), so a step whose report never reached the
master but is in the checkpoint is not read again.

The actor stands in for the JobMaster's shard methods (each forwards to a real
``ShardService``, as ``dlrover_core/master/job_master.py`` does), so that the test can
drop one report on its way; ``tests/test_elastic_job.py`` runs the real JobMaster."""

from __future__ import annotations

import types

import ray

from dlrover_core.master.shards import ShardRegistry


class _Master:
    def __init__(self) -> None:
        self.shards = ShardRegistry()

    def shards_open(self, role, config):
        return self.shards.open(role, config)

    def shards_lease(self, role, rank, generation):
        return self.shards.get(role).lease(rank, generation)

    def shards_report(self, role, generation, rank, step, spans):
        self.shards.get(role).report(generation, rank, step, spans)

    def shards_restore(self, role, step):
        return self.shards.get(role).restore(step)

    def shards_restore_state(self, role, step, state):
        return self.shards.get(role).restore(step, state)

    def ledger(self):
        return self.shards.ledger()


def _restored_read(with_state: bool) -> dict:
    from dlrover_core.runtime.sharding import ShardSampler

    master = ray.remote(_Master).remote()
    workload = types.SimpleNamespace(master_handle=master, role="trainer", rank=0)
    sm = ShardSampler.for_workload(workload, batch_size=4, num_samples=32,
                                   batches_per_shard=1)
    sm.restore(-1)
    for step in range(3):
        sm.next_indices()
        sm.step_done(step)
    state = sm.state_dict()  # steps 0..2; waits for the reports
    sm.next_indices()
    sm._call, call = (lambda *a: None), sm._call  # step 3's report never arrives...
    sm.step_done(3)
    sm._call = call
    state = sm.state_dict()  # ...but the checkpoint of steps 0..3 holds it
    again = ShardSampler.for_workload(workload, batch_size=4, num_samples=32,
                                      batches_per_shard=1)
    if with_state:
        again.load_state_dict(state)
    again.restore(3)
    got = again.next_indices()
    ledger = ray.get(master.ledger.remote())
    ray.kill(master)
    return {"read": again._trained, "next": got, "ledger": ledger}


def test_state_restore_through_the_master_and_the_restore_by_step(ray_cluster):
    with_state = _restored_read(True)
    assert with_state["read"] == {0: 4, 1: 8, 2: 12, 3: 16}
    assert with_state["next"] == [16, 17, 18, 19]
    assert with_state["ledger"]["samples_duplicated"] == 0
    assert with_state["ledger"]["samples_lost"] == 0
    by_step = _restored_read(False)  # no checkpoint state: step 3's samples are read again
    assert by_step["read"] == {0: 4, 1: 8, 2: 12}
    assert by_step["next"] == [12, 13, 14, 15]
