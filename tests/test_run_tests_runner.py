"""`make test`'s runner (scripts/run_tests.py), interrupted for real.

The runner is started in its own session and its process group gets SIGINT, as a
terminal's Ctrl-C sends it. Its suites are small stand-ins (a core suite whose test
starts a real Ray cluster and waits, a plugin suite that waits), so the test takes
seconds instead of a whole `make test`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "scripts" / "run_tests.py"

CORE_TEST = '''
import json, os, time
import psutil, ray

def test_holds_a_ray_cluster():
    ray.init(num_cpus=1, include_dashboard=False)
    kids = [p.pid for p in psutil.Process().children(recursive=True)]
    with open(os.environ["RUNNER_TEST_PIDS"], "w") as f:
        json.dump({"pytest": os.getpid(), "ray": kids}, f)
    print("ready", flush=True)
    time.sleep(300)
'''

PLUGIN_TEST = '''
import time

def test_one():
    assert 1 + 1 == 2

def test_two():
    assert 2 + 2 == 4

def test_waits():
    time.sleep(300)
'''

PLUGIN_TOML = '''
[project]
name = "fake-plugin"
version = "0"
[tool.pytest.ini_options]
markers = ["slow: long"]
'''


def _suites(tmp: Path) -> tuple[Path, Path, Path]:
    core = tmp / "core_tests"
    core.mkdir()
    (core / "test_core_wait.py").write_text(CORE_TEST)
    later = tmp / "later"  # third in the queue, behind two suites that wait: never starts
    for plugin in (tmp / "fakeplug", later):
        (plugin / "tests").mkdir(parents=True)
        (plugin / "pyproject.toml").write_text(PLUGIN_TOML)
        (plugin / "tests" / "test_plugin_wait.py").write_text(PLUGIN_TEST)
    return core, tmp / "fakeplug", later


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow  # starts suites and a Ray cluster: ~10 s
def test_ctrl_c_stops_every_suite_and_its_ray_cluster(tmp_path):
    core, plug, later = _suites(tmp_path)
    pids_file = tmp_path / "pids.json"
    logs = tmp_path / "logs"
    env = dict(os.environ, RUNNER_TEST_PIDS=str(pids_file), SLOW="")
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), "--core", str(core), "--plugins", f"{plug} {later}",
         "--logs", str(logs), "--progress-s", "1", "--grace-s", "10"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        # 120 s was too short in CI (2026-12-02, beside a crash-point run: load 10-19)
        deadline = time.monotonic() + 360
        plug_log = logs / "02-fakeplug.log"
        while not pids_file.exists() or not plug_log.exists() or ".." not in plug_log.read_text():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the suites never got going"
            time.sleep(0.5)
        time.sleep(2)  # a progress line or two
        pids = json.loads(pids_file.read_text())
        assert pids["ray"], "the stand-in core test saw no Ray process"
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C on the terminal does
        out, _ = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert stopped_s < 30, (stopped_s, out)  # the grace is 10 s: a hang would be minutes
    assert "core: interrupted" in out, out
    assert f"{plug}/: interrupted" in out, out
    assert f"{later}/: not started" in out, out
    assert f"== logs: {logs}" in out, out
    # progress while the suites ran: the two quick tests, before the third waits
    assert f"== {plug}/: 2 tests done, 0 failed so far" in out, out
    assert not (logs / "03-later.log").exists()  # nothing started after the Ctrl-C
    time.sleep(1)
    left = [p for p in [pids["pytest"], *pids["ray"]] if _alive(p)]
    assert not left, [psutil.Process(p).cmdline() for p in left]


def _failing_core_and_plugin(tmp: Path, plugin: str, test_file: str,
                             test_text: str) -> tuple[Path, Path]:
    """A core suite whose one test fails, and a plugin suite with ``test_text``."""
    core = tmp / "core_tests"
    core.mkdir()
    (core / "test_fails.py").write_text("def test_no():\n    assert 1 == 2\n")
    plug = tmp / plugin
    (plug / "tests").mkdir(parents=True)
    (plug / "pyproject.toml").write_text(PLUGIN_TOML)
    (plug / "tests" / test_file).write_text(test_text)
    return core, plug


def test_the_runner_reports_a_failed_suite_and_keeps_going(tmp_path):
    core, plug = _failing_core_and_plugin(tmp_path, "okplug", "test_ok.py",
                                          "def test_ok():\n    assert True\n")
    r = subprocess.run(
        [sys.executable, str(RUNNER), "--core", str(core), "--plugins", str(plug),
         "--logs", str(tmp_path / "logs")],
        cwd=tmp_path, env=dict(os.environ, SLOW=""), capture_output=True, text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout
    assert "FAILED suites: core" in r.stdout, r.stdout
    assert f"== {plug}/: exit 0" in r.stdout, r.stdout
    assert "1 passed" in r.stdout and "1 failed" in r.stdout, r.stdout
    # after every log, where CI's cut output still shows it: the failed suite, its exit
    # status and pytest's short summary of its failures; nothing of the suite that passed
    tail = r.stdout[r.stdout.index("the lanes ended after"):]
    assert "== core: exit 1 after" in tail, tail
    assert "FAILED core_tests/test_fails.py::test_no - assert 1 == 2" in tail, tail
    assert "okplug" not in tail.split("== logs:")[1].split("FAILED suites:")[0], tail


def test_a_run_stopped_by_sigterm_still_says_why_an_earlier_suite_failed(tmp_path):
    """CI stops a run that overruns its time with SIGTERM: the failures of the suites
    that had ended are printed after the interrupted run's list, at the end of the
    output that CI keeps."""
    core, plug = _failing_core_and_plugin(tmp_path, "waitplug", "test_plugin_wait.py",
                                          PLUGIN_TEST)
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), "--core", str(core), "--plugins", str(plug),
         "--logs", str(logs), "--lanes", "1", "--progress-s", "1", "--grace-s", "5"],
        cwd=tmp_path, env=dict(os.environ, SLOW=""), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        # 120 s was too short in CI (2026-12-02, beside a crash-point run: load 10-19)
        deadline = time.monotonic() + 360
        plug_log = logs / "02-waitplug.log"  # one lane: it starts after the core failed
        while not plug_log.exists() or ".." not in plug_log.read_text():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the plugin suite never got going"
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, out
    tail = out[out.index("== interrupted after"):]
    assert f"{plug}/: interrupted" in tail, tail
    after = tail[tail.index("== logs:"):]
    assert "== core: exit 1 after" in after, tail
    assert "FAILED core_tests/test_fails.py::test_no - assert 1 == 2" in after, tail
    assert "waitplug" not in after.split("\n", 1)[1], tail  # nothing of the suite stopped


QUEUE_CORE = '''
import os, pathlib, time
import pytest

MARKS = pathlib.Path(os.environ["RUNNER_TEST_MARKS"])


def _ran(name):
    (MARKS / name).write_text(str(os.getpid()))


def test_core_waits_for_every_other_suite():
    # not slow: first in the queue; it ends only once every other suite has run, which
    # needs the other lane to take them all, one after another
    _ran("core-fast")
    others = {"slow-a1", "slow-a2", "slow-b", "slow-c", "plug-one", "plug-two"}
    deadline = time.monotonic() + 120
    while not others <= {p.name for p in MARKS.iterdir()}:
        assert time.monotonic() < deadline, sorted(p.name for p in MARKS.iterdir())
        time.sleep(0.2)
'''


def test_with_slow_one_lane_takes_every_suite_the_other_is_not_running(tmp_path):
    """SLOW=1: the slow tests of the file named by --slow-first as the queue's first
    suite, the core's other slow tests as chunks of whole files (files of two and one
    slow tests into two chunks: the larger first), and the queue shared: while the
    core's other tests hold one lane, the other lane runs the three slow suites and both
    plugins. With fixed lanes (the core's slow tests in one, its other tests and the
    plugins in the other) the core's waiting test would hold the plugins back and fail."""
    core = tmp_path / "core_tests"
    core.mkdir()
    (core / "test_core_fast.py").write_text(QUEUE_CORE)
    (core / "test_core_slow_a.py").write_text(
        "import os, pathlib, pytest\n"
        "M = pathlib.Path(os.environ['RUNNER_TEST_MARKS'])\n"
        "@pytest.mark.slow\ndef test_a1():\n    (M / 'slow-a1').write_text(str(os.getpid()))\n"
        "@pytest.mark.slow\ndef test_a2():\n    (M / 'slow-a2').write_text(str(os.getpid()))\n"
        "def test_not_slow_here():\n    pass\n")
    (core / "test_core_slow_b.py").write_text(
        "import os, pathlib, pytest\n"
        "M = pathlib.Path(os.environ['RUNNER_TEST_MARKS'])\n"
        "pytestmark = pytest.mark.slow\n"
        "def test_b():\n    (M / 'slow-b').write_text(str(os.getpid()))\n")
    (core / "test_core_slow_c.py").write_text(
        "import os, pathlib, pytest\n"
        "M = pathlib.Path(os.environ['RUNNER_TEST_MARKS'])\n"
        "@pytest.mark.slow\ndef test_c():\n    (M / 'slow-c').write_text(str(os.getpid()))\n")
    (core / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'slow: long')\n")
    plugins = []
    for name in ("one", "two"):
        plug = tmp_path / f"plug{name}"
        (plug / "tests").mkdir(parents=True)
        (plug / "pyproject.toml").write_text(PLUGIN_TOML)
        (plug / "tests" / f"test_{name}.py").write_text(
            "import os, pathlib\n"
            f"def test_{name}():\n"
            f"    (pathlib.Path(os.environ['RUNNER_TEST_MARKS']) / 'plug-{name}')"
            ".write_text(str(os.getpid()))\n")
        plugins.append(str(plug))
    marks = tmp_path / "marks"
    marks.mkdir()
    logs = tmp_path / "logs"
    r = subprocess.run(
        [sys.executable, str(RUNNER), "--core", str(core), "--plugins", " ".join(plugins),
         "--order", "plugtwo plugone", "--slow-chunks", "2", "--lanes", "2",
         "--slow-first", str(core / "test_core_slow_b.py"),
         "--logs", str(logs)],
        cwd=tmp_path, env=dict(os.environ, SLOW="1", RUNNER_TEST_MARKS=str(marks)),
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every suite passed" in r.stdout, r.stdout
    # the queue: the --slow-first suite, the core's other tests, its two slow chunks
    # (the larger first), the plugins in --order
    assert sorted(p.name for p in logs.iterdir()) == [
        "01-core-slow-first.log", "02-core.log", "03-core-slow-1.log", "04-core-slow-2.log",
        "05-plugtwo.log", "06-plugone.log"], sorted(p.name for p in logs.iterdir())
    assert "1 passed" in (logs / "01-core-slow-first.log").read_text()
    assert "2 passed" in (logs / "03-core-slow-1.log").read_text()
    assert "1 passed" in (logs / "04-core-slow-2.log").read_text()
    # each slow test ran once, in its suite's process; the not-slow ones in the core's
    pids = {p.name: p.read_text() for p in marks.iterdir()}
    assert pids["slow-a1"] == pids["slow-a2"] != pids["slow-c"] != pids["slow-b"], pids
    assert len(set(pids.values())) == 6, pids
    assert "2 passed, 4 deselected" in (logs / "02-core.log").read_text()


def test_with_slow_a_core_suite_that_cannot_be_collected_fails_the_run(tmp_path):
    """SLOW=1 deals the core's slow tests out by pytest's collection; a test file that
    fails to import must fail the run (the slow tests run as one suite, which reports
    the error), not leave the slow tests out in silence."""
    core = tmp_path / "core_tests"
    core.mkdir()
    (core / "test_broken.py").write_text("import no_such_module_here\n")
    (core / "test_fine.py").write_text(
        "import pytest\n@pytest.mark.slow\ndef test_s():\n    pass\n")
    (core / "conftest.py").write_text(
        "def pytest_configure(config):\n"
        "    config.addinivalue_line('markers', 'slow: long')\n")
    r = subprocess.run(
        [sys.executable, str(RUNNER), "--core", str(core), "--logs", str(tmp_path / "logs")],
        cwd=tmp_path, env=dict(os.environ, SLOW="1"), capture_output=True, text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout
    assert "FAILED suites: core core (slow)" in r.stdout, r.stdout
    assert "no_such_module_here" in (tmp_path / "logs" / "02-core-slow-1.log").read_text()
