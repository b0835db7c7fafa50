"""A user's own graph with a stateful role outside the templates' base classes
(tests/stateful_graph.py): the role declares its state with a ``state_dict`` /
``load_state_dict`` pair, the driver commits it at each iteration boundary
(``BaseTrainer.commit_roles``) and restores it after a restart
(``BaseTrainer.resume_roles``). Its process is SIGKILLed from outside mid-run (pid as
the master reports it) and the run must end bit for bit where an unkilled run ends;
before, the killed role came back with its initial weights (``weights_crc`` and
``seen`` differ). Also, without Ray, how a role's declared state is read."""

from __future__ import annotations

import json
import os

import pytest

from dlrover_core import DLJobBuilder
from dlrover_core.runtime.context import WorkerContext
from dlrover_core.runtime.role_state import declared_objects
from dlrover_core.spec.errors import SpecError

MOD = "tests.stateful_graph"
ITERATIONS = 10


def _ctx(config: dict) -> WorkerContext:
    return WorkerContext(job="j", role="learner", rank=0, world_size=1, local_rank=0,
                         local_world_size=1, config=config)


def test_a_roles_declared_state_and_the_stateful_flag():
    from tests.stateful_graph import Feeder, Learner

    learner = Learner(_ctx({}))
    learner.setup()
    objs = declared_objects(learner)
    assert list(objs) == ["state"]  # the workload's own pair, saved whole
    saved = objs["state"].state_dict()
    learner.seen = 99
    objs["state"].load_state_dict(saved)
    assert learner.seen == 0
    assert declared_objects(Feeder(_ctx({}))) is None  # nothing declared: stateless
    assert declared_objects(Learner(_ctx({"stateful": False}))) is None  # turned off
    with pytest.raises(SpecError, match=r"roles\.learner\.config\.stateful.*Feeder has "
                                        r"neither state_objects\(\)"):
        Feeder(_ctx({"stateful": True})).has_state()
    with pytest.raises(SpecError, match=r"roles\.learner\.config\.stateful: 'yes'.*true or"):
        declared_objects(Learner(_ctx({"stateful": "yes"})))


def _run(job_dir: str, kill: str | None) -> dict:
    from dlrover_core.testing import run_killing

    job = (DLJobBuilder().name(f"custom-state-{kill or 'none'}")
           .trainer(MOD, "CommitDriver")
           .config({"iterations": ITERATIONS, "step_sleep_s": 0.3})
           .workload("feeder", MOD, "Feeder").resource(cpu=0.3)
           .workload("learner", MOD, "Learner").resource(cpu=0.3)
           .edge("feeder", "learner")
           .build())
    return run_killing(job.spec, job_dir, kill, at_step=3, before_step=ITERATIONS - 1)[0]


@pytest.mark.slow
def test_a_custom_stateful_role_killed_mid_run_ends_bit_for_bit_as_unkilled(
        ray_cluster, tmp_path):
    ref = _run(str(tmp_path / "unkilled"), None)["metrics"]
    job_dir = str(tmp_path / "killed")
    summary = _run(job_dir, "learner-0")
    assert summary["restarts"]["total"] == 1
    assert summary["failures"][0]["role"] == "learner"
    m = summary["metrics"]
    # restored to the driver's commit: the same weights and momentum, bit for bit, and
    # every iteration's samples counted once
    assert m["weights_crc"] == ref["weights_crc"]
    assert m["seen"] == ITERATIONS * 8 == ref["seen"]
    assert m["iterations_done"] == ITERATIONS and m["loss_sum"] == ref["loss_sum"]
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        steps = [r["step"] for r in map(json.loads, f)
                 if r.get("role") == "driver" and "weights_crc" not in r]
    # reported after the commit: once each (the master logs in arrival order: sorted)
    assert sorted(steps) == list(range(ITERATIONS))
