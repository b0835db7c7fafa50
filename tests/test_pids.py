"""``dlrover_core.pids.pid_alive`` on real processes: running, zombie, reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dlrover_core.pids import pid_alive


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_running_child_is_alive_a_zombie_and_a_reaped_one_are_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.time() + 60
        while _state(child.pid) != "Z" and time.time() < deadline:  # not reaped yet
            time.sleep(0.05)
        assert _state(child.pid) == "Z"
        assert not pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)


def test_own_process_is_alive_and_no_pid_below_one_is():
    assert pid_alive(os.getpid())
    assert pid_alive(1)  # init: another user's process where not root
    assert not pid_alive(0) and not pid_alive(-1)
