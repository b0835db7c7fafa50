"""``dlrover timeline`` for script roles (no steps): each attempt says how it ended, the
step panel says why it is empty, and the goodput breakdown has no productive part.
A hand-written job directory here; a real job in tests/test_script_node_loss.py."""

from __future__ import annotations

import pytest

from dlrover_core.cli.job_files import JobFiles
from dlrover_core.cli.timeline_model import build_timeline
from tests.test_cli_timeline_model import write_job

KILLED = ("trainer-1: script 'train.py' ended with signal SIGKILL (9); its last error: "
          "RuntimeError: Connection closed by peer")
EVENTS = [
    (0.0, "job_started", {"job": "s", "roles": {
        "trainer": {"total": 2, "per_node": 2, "backend": "torchrun"},
        "helper": {"total": 1, "per_node": 1, "backend": None}}}),
    (2.0, "instance_started", {"role": "trainer", "rank": 0, "attempt": 0}),
    (2.0, "instance_started", {"role": "trainer", "rank": 1, "attempt": 0}),
    (2.5, "instance_started", {"role": "helper", "rank": 0, "attempt": 0}),
    (6.0, "instance_failed", {"role": "trainer", "rank": 1, "kind": "exception",
                              "message": KILLED, "step": -1}),
    (6.0, "failure_classified", {"role": "trainer", "rank": 1, "level": "process"}),
    (6.1, "recovery_started", {"level": "process"}),
    (7.0, "instance_started", {"role": "trainer", "rank": 0, "attempt": 1}),
    (7.0, "instance_started", {"role": "trainer", "rank": 1, "attempt": 1}),
    (7.1, "recovery_finished", {"level": "process", "seconds": 1.0, "phases": {
        "survivor_abort": {"trainer-0": "script stopped (SIGTERM)"}}}),
    (9.0, "instance_failed", {"role": "trainer", "rank": 0, "kind": "exception", "step": -1,
                              "message": "trainer-0: script 'train.py' ended with exit code 3"}),
    (9.0, "instance_finished", {"role": "helper", "rank": 0, "step": -1}),
    (9.5, "job_finished", {"status": "failed"}),
]


@pytest.fixture
def script_job(tmp_path):
    return write_job(tmp_path / "s", EVENTS, [], {"name": "s", "status": "failed"})


def test_attempts_say_how_they_ended(script_job):
    tl = build_timeline(JobFiles.read(script_job))
    assert tl.script_roles == ["trainer"] and tl.steps == []
    exits = {r.label: [(a.attempt, a.outcome, a.exit) for a in r.attempts] for r in tl.rows}
    assert exits == {
        "trainer-0": [(0, "restarted", "script stopped (SIGTERM)"),
                      (1, "failed", "exit code 3")],
        "trainer-1": [(0, "failed", "signal SIGKILL (9)"), (1, "stopped", "job ended")],
        "helper-0": [(0, "finished", "finished")],  # not a script: no exit code
    }
    assert tl.goodput is None
    b = tl.breakdown
    assert b["startup"] == 2.0  # to the first script start, not the (missing) first step
    assert b["recovery"] == 1.0 and b["productive"] == 0.0
    assert b["other"] == pytest.approx(9.5 - 2.0 - 1.0)


def test_restart_without_survivor_abort_names_the_recovery(tmp_path):
    events = [e if e[1] != "recovery_finished" else
              (7.1, "recovery_finished", {"level": "process", "seconds": 1.0, "phases": {}})
              for e in EVENTS]
    tl = build_timeline(JobFiles.read(write_job(tmp_path / "n", events, [])))
    assert tl.rows[0].label == "trainer-0"
    assert tl.rows[0].attempts[0].exit == "process recovery"  # recovery_started's level


def test_png_labels_script_attempts(script_job, tmp_path):
    pytest.importorskip("matplotlib")
    from dlrover_core.cli import timeline_plot as tp

    tl = build_timeline(JobFiles.read(script_job))
    fig, axes = tp.save_timeline(tl, str(tmp_path / "s.png"))
    labels = {t.get_text(): t.xy for t in axes["rows"].texts if hasattr(t, "xy")}
    assert labels["signal SIGKILL (9)"] == (6.0, 1)  # at the attempt's end, on its row
    assert labels["exit code 3"] == (9.0, 0)
    assert "finished" not in labels  # the helper is not a script role
    (note,) = [t.get_text() for t in axes["steps"].texts]
    assert "script role(s) trainer report none" in note


def test_script_backend_is_the_runtime_one():
    """The timeline keeps its own copy of the constant (no Ray import for drawing)."""
    from dlrover_core.cli import timeline_model
    from dlrover_core.runtime import script

    assert timeline_model.SCRIPT_BACKEND == script.SCRIPT_BACKEND
