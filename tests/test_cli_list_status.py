"""``dlrover list`` and ``dlrover status`` agree, and tables fold paths at separators
(issue 52 item 6).

A job whose JobMaster runs on a Ray cluster the command did not join (several clusters on
one machine: each ``dlrover submit`` without ``--address`` starts its own) showed as
``unfinished`` in ``list``. Here the job directory's run lock is held by a real process
(:class:`DirLock` taken in a subprocess, as a submit takes it), no cluster is joined,
and both commands say ``running``; once that process is gone, both say so too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dlrover_core.cli.job_files import find_job
from dlrover_core.cli.jobs_list import jobs_in_root
from dlrover_core.cli.output import console_for, print_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOLD = """
import sys, time
from dlrover_core.master.dir_lock import DirLock
DirLock(sys.argv[1], "job directory", "far").acquire()
print("held", flush=True)
time.sleep(120)
"""


def _job_dir(root, name: str, steps: int) -> str:
    d = os.path.join(root, name)
    os.makedirs(d)
    with open(os.path.join(d, "run.json"), "w") as f:
        json.dump({"name": name, "run": 1, "started_at": time.time() - 5}, f)
    with open(os.path.join(d, "events.jsonl"), "w") as f:
        f.write(json.dumps({"event": "job_started", "ts": time.time() - 5, "job": name}) + "\n")
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "loss": 1.0}) + "\n")
    return d


@pytest.fixture
def held(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = _job_dir(tmp_path / "runs", "far", 7)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, d], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.stdout.readline().strip() == "held"
    yield d, proc
    proc.kill()
    proc.wait()


def _cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``dlrover ARGS`` in ``tmp_path``, where Ray finds no cluster to join (its temp
    directory, where ``address="auto"`` looks, is empty): as on a machine whose jobs all
    run on clusters of their own."""
    noray = tmp_path / "noray"
    noray.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_TMPDIR": str(noray), "COLUMNS": "200"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # 46 s here (2026-12-01): make test's lanes stay near 10 minutes (CI runs it)
def test_list_and_status_say_running_while_the_lock_holder_lives(held, tmp_path):
    d, proc = held
    row, = jobs_in_root("runs")
    assert row["status"] == "running" and row["steps"] == 7, row
    assert "not joined" in row["source"]
    listed = _cli(tmp_path, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)[0]["status"] == "running"
    # status: from the files, saying so (it was exit 2, "unfinished")
    st = _cli(tmp_path, "status", "far")
    assert st.returncode == 0, st.stderr
    assert f"far run 1 ({d}): running step 6 " in st.stdout and "from its files" in st.stdout
    proc.kill()
    proc.wait()
    row, = jobs_in_root("runs")
    assert row["status"] == "unfinished", row
    assert json.loads(_cli(tmp_path, "list", "--json").stdout)[0]["status"] == "unfinished"
    st = _cli(tmp_path, "status", "far")
    assert st.returncode == 2 and "unfinished" in st.stderr, st.stderr


def test_a_running_job_elsewhere_never_makes_a_local_name_ambiguous(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = _job_dir(tmp_path / "runs", "ng", 3)
    elsewhere = str(tmp_path / "other-root" / "ng")
    assert find_job("ng", running={"ng": elsewhere}).job_dir == local
    # with no local match, the running job is found
    assert find_job("ng2", running={"ng2": elsewhere}).job_dir == elsewhere


def test_table_cells_fold_paths_at_separators(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "60")
    path = "/tmp/pytest-of-root/pytest-109/test_list_after_the_job0/runs/nanogpt"
    print_table(("name", "status", "source"), [("nanogpt", "running", f"cluster, {path}")],
                console=console_for())
    out = capsys.readouterr().out
    cells = "".join(ln.split("│")[3].strip() for ln in out.splitlines() if ln.count("│") == 4)
    assert cells == f"cluster, {path}".replace(" ", ""), out  # nothing lost
    lines = [ln.split("│")[3].strip() for ln in out.splitlines() if ln.count("│") == 4]
    for ln in lines[1:]:  # every fold after the first is at a separator
        assert ln.split("/")[0] in ("", *path.split("/")), (ln, out)
    assert any(ln.endswith("/") for ln in lines), out
    assert "nanogp\n" not in out and "anogpt" not in [ln.strip() for ln in lines], out
