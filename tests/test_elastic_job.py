"""Dynamic data sharding in a real job (real local Ray, 2 gloo ranks under ``ddp``): rank 1
is SIGKILLed mid-run; the ranks restore from the newest checkpoint and the shard service
rolls back to it, so the ledger shows no lost sample and at most one uncheckpointed
window of duplicates (steps after the restored checkpoint x the global batch)."""

from __future__ import annotations

from dlrover_core import load_spec
from dlrover_core.testing import run_job

EVERY, G, B, STEPS = 4, 8, 4, 16


def test_sigkill_loses_no_sample(ray_cluster, job_dir):
    spec = load_spec({
        "name": "elastic-shards",
        "roles": {"trainer": {"workload": "tests.elastic_workloads:ElasticRegression",
                              "total": 2, "per_node": 2, "backend": "ddp"}},
        "checkpoint": {"saver": "disk", "every_steps": EVERY, "keep": 2},
        "failover": {"standby": False, "survivor_grace_s": 3, "pg_timeout_s": 30},
        "node_health": {"skip_node_check": True},  # not about node health: no probe
        "config": {"global_batch": G, "micro_batch": B, "max_steps": STEPS,
                   "batches_per_shard": 2, "sleep_s": 0.05,
                   "fault": {"rank": 1, "step": 10}}})
    summary = run_job(spec, job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["restarts"]["total"] == 1
    assert summary["samples_lost"] == 0
    # killed in step 10; the newest checkpoint held steps 0..7: steps 8, 9 were read again
    assert 0 < summary["samples_duplicated"] <= EVERY * G
    assert summary["samples_duplicated"] == 2 * G
    ledger = summary["shards"]["trainer"]
    assert ledger["samples_trained"] == ledger["samples_total"] == G * STEPS
    assert "world_sizes" not in summary  # no elastic role
