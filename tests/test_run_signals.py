"""Signals to ``dlrover-run`` as torchrun handles them: a real SIGTERM to the
``dlrover-run`` process (an embedded Ray, whose driver would otherwise take it) reaches
every rank's script as SIGTERM; a rank that goes on is SIGKILLed after
``--shutdown-timeout`` s; dlrover-run exits 1, as torchrun does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover_core.pids import pid_alive

BIN = Path(sys.executable).parent

SCRIPT = '''
import os, signal, sys, time

OUT, RANK = sys.argv[1], os.environ["RANK"]


def on_signal(signum, frame):
    with open(os.path.join(OUT, "got-" + RANK), "w") as f:
        f.write(signal.Signals(signum).name)
    if RANK == "0":
        sys.exit(0)
    # rank 1 goes on: the launcher kills it after its grace period


for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, on_signal)
with open(os.path.join(OUT, "ready-" + RANK), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.05)
'''


def _wait_for(paths, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not written: {[str(p) for p in paths]}"
        time.sleep(0.1)


@pytest.mark.slow  # waits out the grace period: ~15 s
def test_sigterm_reaches_every_rank_then_sigkill_after_the_grace(tmp_path):
    (tmp_path / "hold.py").write_text(SCRIPT)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    job_dir = tmp_path / "job"
    proc = subprocess.Popen([str(BIN / "dlrover-run"), "--nproc-per-node", "2",
                             "--shutdown-timeout", "3", "--job-dir", str(job_dir),
                             "hold.py", str(tmp_path)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for([tmp_path / "ready-0", tmp_path / "ready-1"], 180)
        pids = [int((tmp_path / f"ready-{r}").read_text()) for r in (0, 1)]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err[-3000:]
    assert "got SIGTERM: forwarding it to every rank" in err
    assert "Traceback" not in err and "SIGABRT" not in err  # not Ray's driver handler
    assert [(tmp_path / f"got-{r}").read_text() for r in (0, 1)] == ["SIGTERM", "SIGTERM"]
    assert not any(pid_alive(p) for p in pids)  # rank 1 ignored it: SIGKILLed
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] != "succeeded"
