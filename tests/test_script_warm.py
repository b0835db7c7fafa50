"""Warm interpreters of script roles (``dlrover_core.runtime.warm_script`` and its child
``script_runner``): real runner processes, real signals, a real Ray job whose rank is
SIGKILLed; nothing is mocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dlrover_core.master.events import read_events
from dlrover_core.pids import pid_alive
from dlrover_core.runtime import warm_script
from dlrover_core.runtime.script import parse_command
from dlrover_core.testing import torchrun_script_pid

BIN = Path(sys.executable).parent

PROBE = '''
import json, os, sys
rec = {"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
       "torch_loaded": "torch" in sys.modules, "pid": os.getpid(),
       "env": {k: os.environ.get(k) for k in ("RANK", "TORCHELASTIC_RESTART_COUNT",
                                               "MASTER_PORT", "PROBE_ONLY_AT_GO")},
       "policies": sorted({os.sched_getscheduler(int(t))
                           for t in os.listdir("/proc/self/task")}),
       "frozen": __import__("gc").get_freeze_count()}
with open(os.environ["PROBE_OUT"], "w") as f:
    json.dump(rec, f)
if os.environ.get("PROBE_RAISE"):
    raise ValueError("probe failed on purpose")
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
'''


@pytest.fixture
def work(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "probemod.py").write_text(PROBE.replace("sys.exit(", "EXIT = (")
                                          + "\ndef main():\n    return EXIT\n"
                                          "if __name__ == '__main__':\n    sys.exit(EXIT)\n")
    yield tmp_path
    warm_script.drop_spare()


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PROBE_OUT=str(tmp / "out.json"), RANK="1",
               TORCHELASTIC_RESTART_COUNT="0", MASTER_PORT="1111",
               DLROVER_WARM_PRELOAD="torch")  # not torch._dynamo too: shorter tests
    env.pop("PROBE_EXIT", None)
    env.update(extra)
    return env


def _wait_ready(runner: warm_script.Runner, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not runner.ready():
        assert time.time() < deadline, "the spare never imported torch"
        assert runner.proc.poll() is None, "the spare died"
        time.sleep(0.05)


@pytest.mark.parametrize("command,argv0,path0", [
    ("probe.py --a 1", "probe.py", "{tmp}"),
    ("-m probemod --a 1", "{tmp}/probemod.py", "{tmp}"),
    ("probemod:main --a 1", "probemod", ""),
])
def test_runner_runs_the_command_like_python_does(work, command, argv0, path0):
    """A new runner given the go message runs each command form as ``__main__`` with
    the go message's environment, ``sys.argv``, working directory and ``sys.path[0]``
    (as ``python file``, ``python -m`` and ``python -c`` set it); the exit code is the
    command's."""
    env = _env(work, PROBE_EXIT="5", PROBE_ONLY_AT_GO="yes")
    proc, how = warm_script.start(parse_command(command), str(work), env, ["probe"])
    assert how == "new" and proc.wait(timeout=120) == 5
    rec = json.loads((work / "out.json").read_text())
    tmp = str(work)
    assert rec["argv"] == [argv0.format(tmp=tmp), "--a", "1"]
    assert rec["path0"] == path0.format(tmp=tmp) and rec["cwd"] == tmp
    assert rec["name"] in ("__main__", "probemod")  # the function's module is imported
    assert rec["env"]["PROBE_ONLY_AT_GO"] == "yes" and rec["pid"] == proc.pid


SIGMASK = '''
import os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
with open(os.environ["PROBE_OUT"], "w") as f:
    f.write(status["SigBlk"].strip())
'''


def test_the_script_starts_with_no_signal_blocked(work):
    """A runner started from a thread that blocks signals (a Ray worker's thread blocks
    SIGINT) still runs the command with none blocked, as torchrun's workers start: a
    SIGINT forwarded to a rank must reach the script (blocked, it stayed pending until
    the SIGKILL after the grace period)."""
    (work / "sigmask.py").write_text(SIGMASK)
    box: list = []

    def start() -> None:  # the mask of this thread is what a forked child inherits
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        proc = warm_script.start(parse_command("sigmask.py"), str(work), _env(work),
                                 ["sigmask"])[0]
        box.append(proc.wait(timeout=120))  # the child dies with this thread (PDEATHSIG)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    assert box == [0]
    assert int((work / "out.json").read_text(), 16) == 0


def test_uncaught_exception_exits_1(work):
    proc, _ = warm_script.start(parse_command("probe.py"), str(work),
                                _env(work, PROBE_RAISE="1"), ["probe"])
    assert proc.wait(timeout=120) == 1


ENDING = '''
import atexit, os, sys, threading, time
out = os.environ["PROBE_OUT"]
log = open(out + ".log", "w")          # never closed: its buffer must still reach the file
log.write("buffered line\\n")
def late():
    time.sleep(0.3)
    with open(out + ".thread", "w") as f:
        f.write("joined")
threading.Thread(target=late).start()  # not a daemon: the process waits for it
atexit.register(lambda: open(out + ".atexit", "w").write(
    "ran after the thread: " + str(os.path.exists(out + ".thread"))))
sys.exit("bye from the script")
'''


def test_the_runner_ends_like_the_interpreter_threads_atexit_files_exit_status(work, capfd):
    """The runner skips the interpreter's teardown (``os._exit``) but keeps what a
    script sees of its end: non-daemon threads joined, then ``atexit`` handlers, open
    files flushed, ``sys.exit("...")`` printed to stderr with status 1."""
    (work / "ending.py").write_text(ENDING)
    env = _env(work)
    runner = warm_script.Runner(["ending"], str(work), env, preload=False)
    proc = runner.go(env, str(work), "script", "ending.py", [])
    proc.wait(timeout=120)
    err = capfd.readouterr().err  # the runner writes to this process's stderr
    assert proc.returncode == 1, err
    out = str(work / "out.json")
    assert open(out + ".thread").read() == "joined"
    assert open(out + ".atexit").read() == "ran after the thread: True"
    assert open(out + ".log").read() == "buffered line\n"
    assert "bye from the script" in err


def test_spare_runs_the_next_attempt_with_its_environment(work):
    """A spare started with attempt 0's environment (restart count 1 expected) and
    given a go message that differs only in per-attempt variables runs the script in
    its own process, which had imported torch (and frozen its heap) before the go
    message, with the go message's values."""
    warm_script.keep_spare(["probe.py"], str(work),
                           _env(work, TORCHELASTIC_RESTART_COUNT="1"), idle=False)
    spare = warm_script._spare
    _wait_ready(spare)
    go_env = _env(work, TORCHELASTIC_RESTART_COUNT="1", MASTER_PORT="2222")
    proc, how = warm_script.start(parse_command("probe.py"), str(work), go_env, ["probe"])
    assert how == "warm" and proc is spare.proc and proc.wait(timeout=120) == 0
    rec = json.loads((work / "out.json").read_text())
    assert rec["torch_loaded"] and rec["pid"] == spare.proc.pid
    assert rec["frozen"] > 0  # the heap after the imports was frozen (gc.freeze)
    assert rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert rec["env"]["MASTER_PORT"] == "2222"
    assert warm_script._spare is None  # used up


def test_spare_with_another_environment_is_not_used(work):
    """A variable outside the per-attempt ones differs (read at torch's import): the
    spare is stopped and a new runner runs the script."""
    warm_script.keep_spare(["probe.py"], str(work), _env(work, OMP_NUM_THREADS="1"),
                           idle=False)
    spare = warm_script._spare
    proc, how = warm_script.start(parse_command("probe.py"), str(work),
                                  _env(work, OMP_NUM_THREADS="2"), ["probe"])
    assert how == "new" and proc.pid != spare.proc.pid and proc.wait(timeout=120) == 0
    assert spare.proc.poll() is not None and not pid_alive(spare.proc.pid)


def test_idle_spare_runs_the_script_at_normal_priority(work):
    """A spare started under SCHED_IDLE is idle while it waits; every thread of the
    script runs under SCHED_OTHER after the go message."""
    if not warm_script.can_leave_idle():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE, RLIMIT_NICE)")
    warm_script.keep_spare(["probe.py"], str(work), _env(work), idle=True)
    spare = warm_script._spare
    _wait_ready(spare)
    assert os.sched_getscheduler(spare.proc.pid) == os.SCHED_IDLE
    proc, how = warm_script.start(parse_command("probe.py"), str(work), _env(work),
                                  ["probe"])
    assert how == "warm" and proc.wait(timeout=120) == 0
    assert json.loads((work / "out.json").read_text())["policies"] == [os.SCHED_OTHER]


def test_dropped_spare_ends_and_a_bad_switch_is_named(work):
    warm_script.keep_spare(["probe.py"], str(work), _env(work), idle=False)
    spare = warm_script._spare
    warm_script.drop_spare()
    assert spare.proc.poll() is not None and warm_script._spare is None
    assert not (work / "out.json").exists()
    assert warm_script.spares_enabled({}) and not warm_script.spares_enabled(
        {warm_script.SWITCH: "0"})
    with pytest.raises(ValueError, match="DLROVER_WARM_RESTART='yes'.*'0'.*'1'"):
        warm_script.spares_enabled({warm_script.SWITCH: "yes"})


SLOW_READER = '''
import os, sys, threading, time
from dlrover_core.runtime.script import wait_output_written
r, w = os.pipe()
os.dup2(w, 1)  # fd 1 is a pipe, as under the log capture
path = sys.argv[1]
os.write(1, b"x" * 1000 + b"\\nValueError: last\\n")

def pump():  # a reader that takes 0.5 s before it moves the bytes to the file
    time.sleep(0.5)
    with open(path, "ab") as f:
        f.write(os.read(r, 65536))

threading.Thread(target=pump).start()
wait_output_written(path, 30.0)
with open(sys.argv[2], "wb") as f:
    f.write(open(path, "rb").read() if os.path.exists(path) else b"")
'''


def test_wait_output_written_waits_for_the_pipe_to_reach_the_file(tmp_path):
    """Output still in the pipe behind fd 1 (the log capture's) is in the file once
    ``wait_output_written`` returns (a dead script's last error line)."""
    (tmp_path / "c.py").write_text(SLOW_READER)
    res = subprocess.run([sys.executable, str(tmp_path / "c.py"), str(tmp_path / "log"),
                          str(tmp_path / "seen")], capture_output=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "seen").read_bytes().endswith(b"ValueError: last\n")


LOOP = '''
import datetime, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(f"seen-{rank}-{restart}", "w") as f:
    f.write(f"{os.getpid()} {os.environ['MASTER_PORT']} "
            f"{os.environ['TORCHELASTIC_USE_AGENT_STORE']}")
while restart == 0 or not os.path.exists("stop"):  # restart 1: until the test says
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.05)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_restart_runs_in_the_spare_started_before_the_failure(tmp_path):
    """``dlrover-run --max-restarts 1``: before the failure, each rank has a spare
    interpreter for restart 1 (``TORCHELASTIC_RESTART_COUNT=1`` in its start
    environment); rank 1's script is SIGKILLed; the restarted group runs in those spare
    processes with the restart count 1 and a new rendezvous port, whose store rank 0's
    actor hosts (``TORCHELASTIC_USE_AGENT_STORE=True``; the first start: ``False``); the
    logs say the interpreter was a spare; rank 1 starts no spare for a restart 2 (the
    budget is 1); the job succeeds."""
    (tmp_path / "loop.py").write_text(LOOP)
    run_id = f"warm-{os.getpid()}"
    job_dir = tmp_path / "job"
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([str(BIN / "dlrover-run"), "--nproc_per_node", "2",
                             "--max-restarts", "1", "--rdzv-id", run_id, "--job-dir",
                             str(job_dir), "--quiet", "loop.py"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        victim = torchrun_script_pid(run_id, 1, script="loop.py")
        spares = [torchrun_script_pid(run_id, r, restart=1, script="loop.py")
                  for r in (0, 1)]
        deadline = time.time() + 120
        while not (tmp_path / "seen-1-0").exists() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        while not all((tmp_path / f"seen-{r}-1").exists() for r in (0, 1)):
            assert time.time() < deadline + 120 and proc.poll() is None, "no restart"
            time.sleep(0.05)
        # each runner starts its spare right after its go message, before the script
        # wrote seen-*: a spare for a restart 2 would exist by now
        with pytest.raises(AssertionError, match="no loop.py process"):
            torchrun_script_pid(run_id, 1, restart=2, script="loop.py", timeout=2)
        (tmp_path / "stop").write_text("")
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        pid, port, agent_store = (tmp_path / f"seen-{rank}-1").read_text().split()
        _, port0, agent_store0 = (tmp_path / f"seen-{rank}-0").read_text().split()
        assert int(pid) == spares[rank] and port != port0
        # the restarted group met at a store rank 0's actor hosts (torchrun's agent store)
        assert (agent_store0, agent_store) == ("False", "True")
        log = (job_dir / "logs" / f"trainer-{rank}" / "attempt-1.log").read_text()
        assert "(restart count 1), interpreter: warm" in log or \
            "(restart count 1), interpreter: warming" in log, log[-2000:]
        log0 = (job_dir / "logs" / f"trainer-{rank}" / "attempt-0.log").read_text()
        assert "(restart count 0), interpreter: new" in log0
    rec = [e for e in read_events(str(job_dir / "events.jsonl"))
           if e["event"] == "recovery_finished"]
    assert len(rec) == 1 and rec[0]["phases"]["survivor_abort"]
