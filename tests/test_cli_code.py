"""Code and imports (issue 29, item 6): ``dlrover validate`` imports the workload and
driver paths; ``submit --working-dir DIR`` ships DIR with the job (Ray's runtime_env
working_dir), so a submit from another directory finds the code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import yaml

from dlrover_core.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKLOAD = textwrap.dedent("""
    from dlrover_core import BaseWorkload


    class Shipped(BaseWorkload):
        def run(self):
            for step in range(int(self.config.max_steps)):
                self.report(step, loss=1.0 / (step + 1))
""")


def _job(tmp_path, workload: str, **extra) -> str:
    spec = {"name": "code-test",
            "roles": {"trainer": {"workload": workload, "total": 1,
                                  "resources": {"cpu": 1}}},
            "config": {"max_steps": 3}, **extra}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_validate_names_the_role_key_the_path_and_the_import_error(tmp_path, capfd):
    job = _job(tmp_path, "no_such_pkg.workload:Nope")
    assert main(["validate", job]) == 2
    err = capfd.readouterr().err
    assert "roles.trainer.workload" in err and "no_such_pkg.workload:Nope" in err
    assert "No module named 'no_such_pkg'" in err


def test_validate_names_a_missing_class(tmp_path, capfd):
    job = _job(tmp_path, "tests.cli_workloads:NoSuchClass")
    assert main(["validate", job]) == 2
    err = capfd.readouterr().err
    assert "roles.trainer.workload" in err and "has no 'NoSuchClass'" in err


def test_validate_names_a_bad_driver(tmp_path, capfd):
    job = _job(tmp_path, "tests.cli_workloads:Chatty", driver="tests.nowhere:Driver")
    assert main(["validate", job]) == 2
    err = capfd.readouterr().err
    assert "driver" in err and "tests.nowhere:Driver" in err and "No module named" in err


def test_validate_imports_from_the_working_dir(tmp_path, capfd):
    code = tmp_path / "code"
    code.mkdir()
    (code / "shipped_wl.py").write_text(WORKLOAD)
    job = _job(tmp_path, "shipped_wl:Shipped")
    assert main(["validate", job]) == 2  # not on sys.path here
    assert "No module named 'shipped_wl'" in capfd.readouterr().err
    assert main(["validate", job, "--working-dir", str(code)]) == 0
    assert "shipped_wl" not in sys.modules or str(code) not in sys.path


def test_submit_ships_the_working_dir(tmp_path):
    """A real submit (its own local Ray cluster, one rank, 3 steps) from a directory that
    does not hold the code."""
    code, elsewhere = tmp_path / "code", tmp_path / "elsewhere"
    code.mkdir()
    elsewhere.mkdir()
    (code / "shipped_wl.py").write_text(WORKLOAD)
    job = _job(tmp_path, "shipped_wl:Shipped")
    env = {**os.environ, "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "submit", job,
                          "--working-dir", str(code), "--json", "--no-progress",
                          "--job-dir", str(tmp_path / "jd")], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["status"] == "succeeded" and summary["steps"] == 3


def test_submit_checks_imports_as_validate_does_before_anything_starts(tmp_path):
    """Issue 52 item 2: a job naming a module that does not exist is refused by ``submit``
    with ``validate``'s exit code and message, before Ray starts, taking no run number."""
    job = _job(tmp_path, "no_such_pkg.workload:Nope")
    jd = tmp_path / "jd"
    cmd = [sys.executable, "-m", "dlrover_core.cli.main"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    val = subprocess.run(cmd + ["validate", job], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    sub = subprocess.run(cmd + ["submit", job, "--job-dir", str(jd)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert val.returncode == 2 and sub.returncode == 2, sub.stderr[-3000:]
    assert "No module named 'no_such_pkg'" in sub.stderr
    assert sub.stderr.strip() == val.stderr.strip()
    assert not jd.exists()  # no job directory, no run number
    assert "Ray" not in sub.stderr and "raylet" not in sub.stderr
