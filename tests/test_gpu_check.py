"""``make gpu-check`` (``scripts/gpu_check.py``) on this CUDA-less machine: it says so and
exits 0; its budget keeps every later part's reserve when a part hangs (real
subprocesses, killed by their process group); its nanoGPT checks tell a CUDA run from a
CPU one. The GPU parts themselves can only run on a machine with CUDA."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from tests.script_files import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


@pytest.fixture
def gpu_check():
    return load_script("scripts/gpu_check.py", "gpu_check")


def test_without_cuda_it_says_so_and_exits_0():
    before = set(glob.glob(os.path.join(ROOT, "runs", "gpu-check", "*")))
    # CUDA hidden, so that the test means the same on a machine with a GPU
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "no CUDA device"
    assert set(glob.glob(os.path.join(ROOT, "runs", "gpu-check", "*"))) == before


def test_part_timeout_sets_the_later_reserves_aside(gpu_check):
    assert gpu_check.part_timeout(0, 240, 180, budget=600) == 240      # its limit
    assert gpu_check.part_timeout(300, 420, 40, budget=600) == 260     # what is left
    assert gpu_check.part_timeout(590, 420, 40, budget=600) == 0.0     # nothing left


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_a_hung_part_is_stopped_with_its_group_and_the_next_keeps_its_reserve(
        gpu_check, monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "BUDGET_S", 20.0)
    monkeypatch.setattr(gpu_check, "GRACE_S", 2.0)
    monkeypatch.setitem(gpu_check.RESERVE_S, "flash_d2h", 12.0)
    monkeypatch.setitem(gpu_check.LIMIT_S, "tests", 300.0)
    pidfile = tmp_path / "child.pid"
    parts = [
        # a hung suite whose shell started a child of its own
        {"part": "tests", "title": "gpu tests: hung", "has_gpu_tests": True,
         "cmd": ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; wait"]},
        {"part": "tests", "title": "gpu tests: none", "has_gpu_tests": False,
         "cmd": ["false"]},
        {"part": "flash_d2h", "title": "flash checkpoint D2H",
         "cmd": ["sh", "-c", "echo measuring; echo '{\"d2h_gib_s\": 3.5}'"]},
    ]
    gpu_check.run_parts(parts, str(tmp_path), 1)
    hung, none, d2h = parts
    assert hung["status"] == "timed_out" and hung["rc"] is None
    assert hung["timeout_s"] == pytest.approx(20.0 - 12.0, abs=0.5)   # d2h's reserve kept
    assert _gone(int(pidfile.read_text())), "the hung part's child outlived it"
    assert none["status"] == "no_gpu_tests"
    assert d2h["timeout_s"] >= 12.0 - 1.0   # the reserve, less the kill's lag
    assert d2h["status"] == "passed" and d2h["figure"] == {"d2h_gib_s": 3.5}


def _job_dir(path, status="succeeded", steps=200, cuda_device=0, gpu_ids=(0,), mib=812.5):
    os.makedirs(path, exist_ok=True)
    metrics = {"loss": 1.2}
    if mib is not None:
        metrics["cuda_max_allocated_mib"] = mib
    with open(os.path.join(path, "summary.json"), "w") as f:
        json.dump({"status": status, "steps": steps, "metrics": metrics}, f)
    with open(os.path.join(path, "events.jsonl"), "w") as f:
        for e in ({"event": "job_started"},
                  {"event": "instance_started", "role": "trainer", "rank": 0,
                   "gpu_ids": list(gpu_ids), "visible_devices": "0",
                   "cuda_device": cuda_device}):
            f.write(json.dumps(e) + "\n")
        f.write('{"event": "job_fin')   # a torn last line is skipped
    return str(path)


def test_nanogpt_checks_need_200_steps_on_a_gpu_of_rays(gpu_check, tmp_path):
    checks, summary, devices = gpu_check.nanogpt_checks(_job_dir(tmp_path / "gpu"))
    assert all(checks.values()), checks
    assert devices == [{"rank": 0, "gpu_ids": [0], "visible_devices": "0", "cuda_device": 0}]
    # what a run on the CPU leaves: no GPU of Ray's, no CUDA memory reported
    cpu, _, _ = gpu_check.nanogpt_checks(_job_dir(tmp_path / "cpu", cuda_device=None,
                                                  gpu_ids=(), mib=None))
    assert [k for k, ok in cpu.items() if not ok] == [
        "every trainer rank started on a GPU of Ray's",
        "rank 0's tensors were on cuda (cuda_max_allocated_mib > 0)"]
    short, _, _ = gpu_check.nanogpt_checks(_job_dir(tmp_path / "short", steps=120))
    assert [k for k, ok in short.items() if not ok] == ["200 steps"]
    assert not any(gpu_check.nanogpt_checks(str(tmp_path / "missing"))[0].values())


def test_a_budget_that_is_not_positive_is_refused_before_anything_runs():
    proc = subprocess.run([sys.executable, SCRIPT, "--budget-s", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--budget-s must be > 0, got 0.0" in proc.stderr
