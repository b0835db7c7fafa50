"""``dlrover list``, ``dlrover logs`` and ``dlrover timeline`` on a real job: 2 DDP
ranks (gloo) of a small workload that prints every step, rank 1 SIGKILLed after step 5,
recovered at the process level: its replacement heals from rank 0's live state (a DDP
rank: ``dlrover_core.checkpoint.heal``), not from the step-4 checkpoint."""

from __future__ import annotations

import json
import os
import signal

import pytest
import ray

from dlrover_core import load_spec
from dlrover_core.cli.jobs_list import list_jobs
from dlrover_core.cli.main import main
from dlrover_core.master.client import create_master
from dlrover_core.master.events import read_events
from dlrover_core.testing import poll_status

NAME = "cli-ft"
SPEC = {"name": NAME,
        "roles": {"trainer": {"workload": "tests.cli_workloads:Chatty", "total": 2,
                              "backend": "ddp", "resources": {"cpu": 1}}},
        "checkpoint": {"saver": "disk", "every_steps": 4, "keep": 2},
        "failover": {"max_restarts": 3, "pg_timeout_s": 30, "survivor_grace_s": 3},
        "observability": {"tensorboard": True},
        "node_health": {"skip_node_check": True},  # not about node health: no probe
        "config": {"max_steps": 16, "step_s": 0.3}}


@pytest.fixture(scope="module")
def job(ray_cluster, tmp_path_factory):
    """Run the job; returns (job root, job dir, the live `dlrover list` rows seen while it
    ran)."""
    root = tmp_path_factory.mktemp("runs")
    job_dir = str(root / NAME)
    master = create_master(load_spec(SPEC), job_dir)
    ray.get(master.start.remote())
    st = poll_status(master, lambda s: s["step"] >= 5 or s["summary"], 240)
    os.kill(st["instances"]["trainer-1"]["pid"], signal.SIGKILL)
    live = list_jobs(str(root), cluster=True)
    summary = poll_status(master, lambda s: s["summary"], 300)["summary"]
    ray.kill(master, no_restart=True)
    assert summary["status"] == "succeeded", summary["error"]
    return str(root), job_dir, live


def test_list_shows_the_running_job_from_the_cluster(job):
    _, _, live = job
    (row,) = [r for r in live if r["name"] == NAME]
    assert row["source"].startswith("cluster")  # the master answered
    assert row["status"] in ("running", "recovering")
    assert row["steps"] >= 6


def test_list_after_the_job(job, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # room for every cell of the table on one line
    root, job_dir, _ = job
    assert main(["list", "--root", root, "--no-cluster", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    with open(os.path.join(job_dir, "summary.json")) as f:
        summary = json.load(f)
    age = row.pop("age_s")
    assert row == {"name": NAME, "run": 1, "status": "succeeded", "steps": 16,
                   "started_at": summary["started_at"],
                   "restarts": summary["restarts"]["total"], "wall_s": summary["wall_s"],
                   "goodput": summary["goodput"], "error": None, "job_dir": job_dir,
                   "source": job_dir}
    # age_s is rounded to 0.1 s: it may sit up to 0.05 s under the true age
    assert summary["ended_at"] - summary["started_at"] <= age + 0.05
    assert row["restarts"] >= 1
    assert main(["list", "--root", root, "--no-cluster"]) == 0
    table = capsys.readouterr().out
    line = next(ln for ln in table.splitlines() if NAME in ln)
    assert "succeeded" in line and job_dir in line


def test_recovery_loads_are_events_not_where_the_run_resumed(job):
    """The killed rank's reload (a heal from the survivor) is a `checkpoint_loaded`
    event of attempt 1; the run itself started from nothing, so its summary has no
    `resumed_from`."""
    _, job_dir, _ = job
    with open(os.path.join(job_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["resumed_from"] is None and summary["run"] == 1
    loads = [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
             if e["event"] == "checkpoint_loaded"]
    assert loads and all(e["attempt"] >= 1 and e["source"] == "peer" for e in loads)
    assert all(e["step"] >= 6 and e["path"] == "" for e in loads)  # past the kill


def test_timeline_png_of_the_failure(job, tmp_path, capsys):
    from matplotlib.image import imread

    from dlrover_core.cli import timeline_plot as tp
    from dlrover_core.cli.job_files import JobFiles
    from dlrover_core.cli.timeline_model import build_timeline

    _, job_dir, _ = job
    out = tmp_path / "timeline.png"
    assert main(["timeline", NAME, "--job-dir", job_dir, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    # what the job wrote, read independently of the timeline code
    events = read_events(os.path.join(job_dir, "events.jsonl"))
    t0 = next(e["ts"] for e in events if e["event"] == "job_started")
    failed = [e for e in events if e["event"] == "instance_failed"]
    # the master may see rank 0's broken collective before rank 1's death: either way
    assert failed and {e["rank"] for e in failed} <= {0, 1}
    assert f"{len(failed)} failures" in printed
    rec = [e for e in events if e["event"] == "recovery_finished"]
    tl = build_timeline(JobFiles.read(job_dir))
    assert [(f.role, f.rank, f.kind) for f in tl.failures] == \
        [(e["role"], e["rank"], e["kind"]) for e in failed]
    assert [f.t for f in tl.failures] == pytest.approx([e["ts"] - t0 for e in failed],
                                                       abs=1e-3)
    assert [r.level for r in tl.recoveries] == [e["level"] for e in rec]
    assert len(tl.checkpoints) == len([e for e in events if e["event"] == "checkpoint_saved"])
    assert sum(tl.breakdown.values()) == pytest.approx(tl.wall_s, rel=1e-3)
    # the same figure the command wrote, drawn again to get its axes: the PNG pixels
    # at the failure's coordinates are the failure colour, elsewhere they are not
    fig, axes = tp.draw_timeline(tl)
    img = imread(str(out))
    assert img.shape[:2] == (int(fig.get_figheight() * fig.dpi),
                             int(fig.get_figwidth() * fig.dpi))
    rows = axes["rows"]

    def px(x, y):
        X, Y = rows.transData.transform((x, y))
        return tuple(int(round(255 * v)) for v in img[int(round(img.shape[0] - Y)),
                                                      int(round(X)), :3])

    red = tuple(int(tp.FAILURE_COLOR[i:i + 2], 16) for i in (1, 3, 5))
    first = tl.failures[0]
    row = tl.row_index(first.role, first.rank)
    assert all(abs(a - b) <= 12 for a, b in zip(px(first.t, row), red))
    # a row with no failure near that time is not red there
    near = {tl.row_index(f.role, f.rank) for f in tl.failures
            if abs(f.t - first.t) < 0.05 * tl.wall_s}
    for other in set(range(len(tl.rows))) - near:
        assert not all(abs(a - b) <= 12 for a, b in zip(px(first.t, other), red))
    # and the failure's row is not red where nothing failed (the start of its bar)
    quiet = tl.rows[row].attempts[0].start + 0.02 * tl.wall_s
    assert all(abs(f.t - quiet) > 0.02 * tl.wall_s for f in tl.failures)
    assert not all(abs(a - b) <= 12 for a, b in zip(px(quiet, row), red))
    # --json prints the same data
    assert main(["timeline", NAME, "--job-dir", job_dir, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in data["rows"]] == ["trainer-0", "trainer-1"]
    assert [f["rank"] for f in data["failures"]] == [e["rank"] for e in failed]


def test_logs_of_the_killed_rank_show_both_attempts(job, capsys):
    _, job_dir, _ = job
    assert main(["logs", NAME, "--job-dir", job_dir, "--role", "trainer", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    a0, a1 = out.index("==> trainer-1 attempt 0 <=="), out.index("==> trainer-1 attempt 1 <==")
    first, second = out[a0:a1], out[a1:]
    assert "setup rank 1 attempt 0 from step 0" in first  # stderr is captured too
    assert "rank 1 step 5 loss" in first  # it reached step 5 before the SIGKILL
    # the new process resumed at the survivor's step (no checkpoint) and ran to the end
    resumed = int(second.split("setup rank 1 attempt 1 from step ")[1].split()[0])
    assert resumed >= 6 and f"rank 1 step {resumed} loss" in second
    assert "rank 1 step 15 loss" in second
    # every rank and attempt, each line prefixed
    assert main(["logs", NAME, "--job-dir", job_dir]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[trainer-0 a0] rank 0 step 0 loss" in "\n".join(lines)
    assert any(ln.startswith("[trainer-0 a1] ") for ln in lines)  # re-set up in place
    assert any(ln.startswith("[trainer-1 a1] rank 1 step 15 ") for ln in lines)


def test_tensorboard_scalars_written_by_the_master(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, job_dir, _ = job
    acc = EventAccumulator(os.path.join(job_dir, "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"trainer/loss", "job/restarts", "job/recovery_s", "job/checkpoint_s",
            "job/goodput", "job/wall_s"} <= tags
    with open(os.path.join(job_dir, "summary.json")) as f:
        summary = json.load(f)
    metrics = {}
    for r in read_events(os.path.join(job_dir, "metrics.jsonl")):
        metrics.setdefault(r["step"], r["loss"])  # steps redone after the restart: first
    loss = {}
    for e in acc.Scalars("trainer/loss"):
        loss.setdefault(e.step, e.value)
    assert sorted(loss) == list(range(16))
    assert loss == pytest.approx(metrics, rel=1e-6)
    assert acc.Scalars("job/restarts")[-1].value == summary["restarts"]["total"]
    assert acc.Scalars("job/goodput")[-1].value == pytest.approx(summary["goodput"], rel=1e-6)
    ckpt = [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
            if e["event"] == "checkpoint_saved"]
    assert [e.step for e in acc.Scalars("job/checkpoint_s")] == [e["step"] for e in ckpt]


def test_driver_logs(ray_cluster, job_dir, capsys):
    from dlrover_core import DLJobBuilder

    job = (DLJobBuilder().name("cli-driver").trainer("tests.cli_workloads", "ChattyDriver")
           .config({"iterations": 2})
           .workload("worker", "tests.workloads", "Echo").total(2).resource(cpu=0.5)
           .build())
    summary = job.submit(job_dir=job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    assert main(["logs", "cli-driver", "--job-dir", job_dir, "--role", "driver"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("=== run 1 of ")  # the run's header, then the driver's attempts
    assert out.splitlines()[1] == "==> driver attempt 0 <=="
    assert "driver iteration 1: worker ranks [0, 1]" in out
    assert "driver done" in out  # stderr too
