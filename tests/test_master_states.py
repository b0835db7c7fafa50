"""The JobMaster's state table is enforced, its instance model is persisted, and the
closed vocabularies are enums that still read and write as plain strings. No Ray:
the controller is built on a real job spec and a real SQLite JobContext, and only
its state transition and the instance table are driven."""

from __future__ import annotations

import json
import os

import pytest

from dlrover_core import Failure, FailoverLevel, FailureKind, FailureVerdict, load_spec
from dlrover_core.master.context import JobContext
from dlrover_core.master.controller import JobController
from dlrover_core.master.events import read_events
from dlrover_core.master.instances import DRIVER, InstanceState, InstanceTable
from dlrover_core.master.states import (
    TRANSITIONS,
    IllegalTransitionError,
    JobState,
    check_transition,
)
from dlrover_core.plugins.manager import PluginManager


@pytest.fixture
def controller(tmp_path):
    spec = load_spec("examples/nanogpt/job.yaml", ["name=states"])
    c = JobController(spec, str(tmp_path), PluginManager())
    yield c
    c.scope.events.close()
    c.progress.close()


def test_illegal_transition_raises_and_changes_nothing(controller, tmp_path):
    with pytest.raises(IllegalTransitionError, match="illegal job transition pending -> "
                                                     "running; allowed from pending: "):
        controller._set_state(JobState.RUNNING)
    assert controller.state == JobState.PENDING
    assert controller.scope.context.get("state") is None  # nothing persisted
    controller._set_state(JobState.PLACING)
    controller._set_state(JobState.STARTING)
    controller._set_state(JobState.RUNNING)
    with pytest.raises(IllegalTransitionError):
        controller._set_state(JobState.PLACING)  # a re-placement must go through RECOVERING
    controller._set_state(JobState.RECOVERING)
    controller._set_state(JobState.PLACING)  # node-level recovery re-places
    assert controller.scope.context.get("state") == "placing"
    changes = [(e["previous"], e["state"]) for e in read_events(
        os.path.join(tmp_path, "events.jsonl")) if e["event"] == "job_state_changed"]
    assert changes == [("pending", "placing"), ("placing", "starting"),
                       ("starting", "running"), ("running", "recovering"),
                       ("recovering", "placing")]


def test_terminal_states_allow_nothing():
    for state in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED):
        assert state.terminal and TRANSITIONS[state] == frozenset()
        with pytest.raises(IllegalTransitionError, match="none \\(terminal\\)"):
            check_transition(state, JobState.RUNNING)
    # success only from RUNNING; stop from every live state
    assert [s for s in JobState if JobState.SUCCEEDED in TRANSITIONS[s]] == [JobState.RUNNING]
    assert all(JobState.STOPPED in TRANSITIONS[s] for s in JobState if not s.terminal)


def test_instance_table_persists_one_model(tmp_path):
    ctx = JobContext(str(tmp_path / "context.sqlite"))
    table = InstanceTable(ctx)
    a = table.register("trainer", 0, None, "dlrover-j-trainer-0-a0", attempt=0)
    b = table.register("trainer", 1, None, "dlrover-j-trainer-1-a0", attempt=0)
    table.register(DRIVER, 0, None, "dlrover-j-driver-a0", attempt=2)
    table.set_node(a, {"node_id": "n1", "ip": "10.0.0.1", "pid": 4242})
    table.set_state(a, InstanceState.RUNNING)
    table.note_report("trainer", 0, 17)
    table.note_report("trainer", 1, 16)
    assert ctx.instances()[1]["last_step"] == -1  # written on the timer, not per report
    assert table.flush_progress() == 2
    assert table.flush_progress() == 0  # nothing new
    rows = {(r["role"], r["rank"]): r for r in JobContext(ctx.path).instances()}
    assert rows[("trainer", 0)] == {"role": "trainer", "rank": 0,
                                    "actor_name": "dlrover-j-trainer-0-a0", "node_id": "n1",
                                    "pid": 4242, "state": "running", "attempt": 0,
                                    "last_step": 17}
    assert rows[("trainer", 1)]["last_step"] == 16 and rows[("trainer", 1)]["state"] == "starting"
    assert rows[(DRIVER, 0)]["attempt"] == 2
    # a report overtaken by a newer one (its step ended earlier) moves no step back,
    # but its arrival still counts (hang detection)
    table.note_report("trainer", 0, 20, ts=200.0)
    a.last_report_ts = 0.0
    table.note_report("trainer", 0, 18, ts=180.0)
    assert (a.last_step, a.last_step_ts) == (20, 200.0) and a.last_report_ts > 0
    table.note_report("trainer", 0, 19, ts=210.0)  # later, a lower step: a rollback
    assert (a.last_step, a.last_step_ts) == (19, 210.0)
    # a new actor in the same slot is a new generation
    b2 = table.register("trainer", 1, None, "dlrover-j-trainer-1-a1", attempt=1)
    assert b2.generation == b.generation + 1 and not table.is_current(b)
    with pytest.raises(ValueError, match="unknown instance column"):
        ctx.update_instance("trainer", 0, bogus=1)


def test_failure_constructors_and_enums():
    f = Failure.hang("trainer", 1, 12.34, 10, node_id="n1", step=5, attempt=2)
    assert f.kind is FailureKind.HANG and f.kind == "hang"
    assert f.message == "no step report for 12.3 s (hang_timeout_s=10)"
    assert (f.role, f.rank, f.node_id, f.step, f.attempt) == ("trainer", 1, "n1", 5, 2)
    lost = Failure.node_lost("trainer", 0, "abcdef0123456789", "raylet died", step=3)
    assert lost.kind == FailureKind.NODE_LOST and lost.exc_type == "NodeLost"
    assert lost.message == "node abcdef012345 left the Ray cluster: raylet died"
    err = Failure.user_error("actor", 0, "builtins.ValueError", "bad", "Traceback...",
                             phase="setup")
    assert (err.kind, err.phase, err.traceback) == ("user_error", "setup", "Traceback...")
    died = Failure.actor_died("rollout", 3, "SIGKILL", phase="run", step=9)
    assert (died.kind, died.exc_type, died.step) == ("actor_died", "ActorDiedError", 9)
    # a plain string still works (plugins, restored history) and becomes the enum
    assert Failure("node_lost").kind is FailureKind.NODE_LOST
    with pytest.raises(ValueError, match="Failure.kind 'oom' is invalid; allowed: actor_died"):
        Failure("oom")
    v = FailureVerdict("role", "again")
    assert v.level is FailoverLevel.ROLE
    with pytest.raises(ValueError, match="failover level 'rack' is not one of process, role"):
        FailureVerdict("rack", "?")
    # persisted and emitted as the plain strings
    assert json.loads(json.dumps(f.as_dict()))["kind"] == "hang"
    assert json.dumps({"level": v.level}) == '{"level": "role"}'
    assert Failure(**json.loads(json.dumps(f.as_dict()))) == f
