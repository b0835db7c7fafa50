"""The nanogpt job end to end with a tiny config: 2 FSDP2 workers over gloo, disk
checkpoints, resume on a second submit; summary.json and events.jsonl well-formed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from dlrover_core import load_spec
from dlrover_core.master.client import submit_job
from dlrover_core.master.events import read_events

TINY = ["config.n_layer=1", "config.n_embd=32", "config.n_head=2", "config.block_size=32",
        "config.batch_size=8", "config.eval_batches=2", "config.lr=1e-2",
        "config.warmup_steps=2", "checkpoint.every_steps=4", "checkpoint.keep=2",
        "node_health.skip_node_check=true"]  # not about node health: no pre-flight probe


def tiny_spec(steps: int, *extra: str):
    return load_spec("examples/nanogpt/job.yaml",
                     TINY + [f"config.max_steps={steps}", f"config.eval_every={steps}", *extra])


@pytest.fixture(scope="module")
def first_run(ray_cluster, tmp_path_factory):
    job_dir = str(tmp_path_factory.mktemp("nanogpt"))
    summary = submit_job(tiny_spec(8), job_dir=job_dir, progress=False)
    return job_dir, summary


def test_job_succeeds_and_loss_falls(first_run):
    job_dir, summary = first_run
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["steps"] == 8 and summary["last_step"] == 7
    assert summary["error"] is None
    assert summary["restarts"]["total"] == 0
    m = summary["metrics"]
    assert m["val_loss"] < math.log(103) - 0.3  # uniform over 103 symbols is 4.63 nats
    steps = [r for r in read_events(os.path.join(job_dir, "metrics.jsonl"))
             if r["event"] == "step" and r["role"] == "trainer"]
    # every step once; in arrival order, which Ray does not keep for a threaded actor
    steps.sort(key=lambda r: r["step"])
    assert [r["step"] for r in steps] == list(range(8))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3
    on_disk = json.load(open(os.path.join(job_dir, "summary.json")))
    assert on_disk == summary
    for key in ("status", "metrics", "steps", "restarts", "wall_s", "error"):
        assert key in on_disk


def test_events_well_formed(first_run):
    job_dir, _ = first_run
    events = read_events(os.path.join(job_dir, "events.jsonl"))
    names = [e["event"] for e in events]
    assert names[0] == "job_started" and names[-1] == "job_finished"
    assert names.count("instance_started") == 2 and names.count("instance_finished") == 2
    assert "placement" in names
    assert [e["step"] for e in events if e["event"] == "checkpoint_saved"] == [4, 8]
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts)
    started = [e for e in events if e["event"] == "instance_started"]
    assert len({e["pid"] for e in started}) == 2
    with open(os.path.join(job_dir, "events.jsonl")) as f:
        for line in f:
            json.loads(line)  # every line is one JSON object


def test_second_submit_resumes(first_run):
    job_dir, _ = first_run
    summary = submit_job(tiny_spec(12), job_dir=job_dir, progress=False)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["metrics"]["resumed_from_step"] == 8
    steps = [r["step"] for r in read_events(os.path.join(job_dir, "metrics.jsonl"))
             if r["event"] == "step" and r["role"] == "trainer"]
    assert steps[-4:] == [8, 9, 10, 11]  # continued, did not start over
    ckpts = sorted(os.listdir(os.path.join(job_dir, "ckpt", "trainer")))
    assert ckpts == ["latest", "step_00000008", "step_00000012"]  # keep=2


@pytest.mark.slow  # three CLI submits: ~11 s
def test_cli_submit_exit_codes(ray_cluster, tmp_path):
    """`dlrover submit` exits 0 only when the job succeeded; bad input exits 2 at once."""
    cli = [sys.executable, "-m", "dlrover_core.cli.main"]
    bad = subprocess.run(cli + ["submit", "examples/nanogpt/job.yaml", "roles.trainer.total=3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "roles.trainer.per_node" in bad.stderr and "not divisible" in bad.stderr
    missing = ["submit", "examples/nanogpt/job.yaml", *TINY, "config.max_steps=2",
               "roles.trainer.workload=examples.nanogpt.workload:NoSuchClass",
               "--job-dir", str(tmp_path / "j"), "--no-progress"]
    refused = subprocess.run(cli + missing, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2  # submit imports the workload as validate does
    assert "has no 'NoSuchClass'" in refused.stderr and not (tmp_path / "j").exists()
    # without that check, the ranks find it at setup: fatal, no restart loop, exit 1
    failing = subprocess.run(cli + missing + ["--no-import-check"], capture_output=True,
                             text=True, timeout=300)
    assert failing.returncode == 1
    summary = json.load(open(tmp_path / "j" / "summary.json"))
    assert summary["status"] == "failed"
    assert "AttributeError" in summary["error"] and "NoSuchClass" in summary["error"]
    assert summary["restarts"]["total"] == 0  # fatal at setup: no restart loop


@pytest.mark.slow  # a CLI job stopped: ~8 s
def test_cli_status_and_stop(ray_cluster, tmp_path, capsys):
    """`dlrover status NAME` reports a running job; `dlrover stop NAME` stops it and the
    submitting side gets the `stopped` summary."""
    import threading
    import time

    from dlrover_core.cli.main import main
    from dlrover_core.master.client import get_master

    result = {}
    job_dir = str(tmp_path / "j")
    t = threading.Thread(target=lambda: result.update(summary=submit_job(
        tiny_spec(100000, "name=cli-stop"), job_dir=job_dir, progress=False)))
    t.start()
    deadline = time.time() + 120
    while get_master("cli-stop") is None or not os.path.exists(
            os.path.join(job_dir, "metrics.jsonl")) or os.path.getsize(
            os.path.join(job_dir, "metrics.jsonl")) == 0:
        assert time.time() < deadline
        time.sleep(0.2)
    assert main(["status", "cli-stop", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "running" and st["step"] >= 0
    assert main(["stop", "cli-stop"]) == 0
    assert "cli-stop: stopped" in capsys.readouterr().out
    t.join(120)
    assert result["summary"]["status"] == "stopped"
    assert main(["status", "cli-stop", "--job-dir", job_dir]) == 0  # from summary.json
