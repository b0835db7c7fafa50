"""Dynamic data sharding in a real job (real local Ray, 2 gloo ranks under ``ddp``): rank 1
is SIGKILLed mid-run; the ranks restore from the newest checkpoint, which holds the shard
state, and the shard service rewinds to it. From the per-sample ids each rank logged per
step: every sample's gradient is in the final model exactly once, and the steps after the
checkpoint that were rolled back are what the ledger counts as re-read."""

from __future__ import annotations

import collections
import json
import os

import pytest

from dlrover_core import load_spec
from dlrover_core.testing import run_job

EVERY, G, B, STEPS = 4, 8, 4, 16


def _records(job_dir: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(job_dir)):
        if name.startswith("ids-") and name.endswith(".jsonl"):
            with open(os.path.join(job_dir, name)) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out


@pytest.mark.slow
def test_sigkill_trains_each_sample_once_in_the_final_model(ray_cluster, job_dir):
    spec = load_spec({
        "name": "elastic-shards",
        "roles": {"trainer": {"workload": "tests.elastic_workloads:ElasticRegression",
                              "total": 2, "per_node": 2, "backend": "ddp"}},
        "checkpoint": {"saver": "disk", "every_steps": EVERY, "keep": 2},
        # in_place false: every rank restarts and restores the checkpoint (in place, the
        # DDP ranks would heal from the survivor's live state, with nothing rolled back)
        "failover": {"standby": False, "survivor_grace_s": 3, "pg_timeout_s": 30,
                     "in_place": False},
        "node_health": {"skip_node_check": True},  # not about node health: no probe
        "elastic": {"global_batch": G, "micro_batch": B},  # reaches the workload's context
        "config": {"max_steps": STEPS,
                   "batches_per_shard": 2, "sleep_s": 0.05,
                   "fault": {"rank": 1, "step": 10}}})
    summary = run_job(spec, job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["restarts"]["total"] == 1
    records = _records(job_dir)
    attempts = sorted({r["attempt"] for r in records})
    assert len(attempts) == 2, attempts
    # where each later attempt started: the step after its restored checkpoint
    start = {a: min(r["step"] for r in records if r["attempt"] == a) for a in attempts}
    with open(os.path.join(job_dir, "loads.jsonl")) as f:
        loads = [json.loads(line)["loaded"] for line in f if line.strip()]
    assert loads == [None, start[attempts[1]]]
    # killed in step 10 with checkpoints every 4 steps: the newest held steps 0..7
    assert start[attempts[1]] == 8
    final, reread = collections.Counter(), 0
    for r in records:
        nxt = [start[a] for a in attempts if a > r["attempt"]]
        if nxt and r["step"] >= nxt[0]:
            reread += len(r["ids"])  # rolled back by the restore: not in the final model
        else:
            final.update(r["ids"])
    assert sorted(final) == list(range(G * STEPS))  # every sample in the final model...
    assert set(final.values()) == {1}                # ...exactly once
    assert reread == 2 * G                           # steps 8 and 9, both ranks
    ledger = summary["shards"]["trainer"]
    assert summary["samples_lost"] == 0
    assert summary["samples_duplicated"] == 0
    assert ledger["samples_reread_after_rollback"] == reread
    assert summary["samples_reread_after_rollback"] == reread
    assert ledger["samples_trained"] == ledger["samples_total"] == G * STEPS
    # the newest checkpoint (step 16) holds every step: every sample is committed
    assert summary["checkpoint_steps"]["trainer"] == STEPS
    assert ledger["samples_committed"] == G * STEPS
    assert summary["samples_not_trained"] == summary["samples_leased_not_trained"] == 0
    assert "world_sizes" not in summary  # no elastic role
