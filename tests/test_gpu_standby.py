"""A warm standby on a one-GPU node (fake: the GPU is a Ray resource only, the
workload computes on the CPU since this machine has no CUDA). Runs
``tests.scenarios.gpu_standby`` in its own Ray cluster (``num_gpus=1``)."""

from __future__ import annotations


import pytest
from tests.scenarios import run_scenario


@pytest.mark.slow
def test_gpu_less_standby_takes_the_killed_ranks_gpu(tmp_path):
    out = run_scenario("gpu_standby", tmp_path / "job", timeout=600)
    assert out["summary"]["status"] == "succeeded", out["summary"].get("error")
    ev = out["events"]
    created = [e for e in ev if e["event"] == "standby_created"]
    # the node's one GPU is the rank's: the spare warms up without one
    assert created and created[0]["gpu_less"] is True
    started = {e["attempt"]: e for e in ev
               if e["event"] == "instance_started" and e["role"] == "trainer"}
    assert sorted(started) == [0, 1]
    assert started[0]["pid"] == out["killed"] and started[1]["pid"] != out["killed"]
    rec = [e for e in ev if e["event"] == "recovery_finished"][0]
    assert rec["phases"]["standby_used"] is True
    # the promoted spare computes on the GPU Ray reserved for the rank (through its lease)
    assert started[0]["gpu_ids"] == started[1]["gpu_ids"] == ["0"]
    assert started[1]["cuda_device"] == 0 and started[1]["visible_devices"] is None
    assert not [e for e in ev if e["event"] == "standby_unusable"]
