"""Worker output captured per instance and attempt, rotated by size, and ``dlrover logs``.

The capture runs in a real child process (it redirects file descriptors 1 and 2), with
output from Python, from a C-level ``write(2)`` and from a child shell command."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dlrover_core.cli.logs import find_sources, follow
from dlrover_core.cli.main import main
from dlrover_core.runtime.log_capture import RotatingFile, attempt_path

CHILD = textwrap.dedent("""
    import os, sys
    from dlrover_core.runtime.log_capture import capture_output
    job_dir, opts = sys.argv[1], {"log_max_bytes": 2048, "log_backups": 2}
    capture_output(job_dir, "trainer", 1, 0, opts)
    print("python stdout a0")
    print("python stderr a0", file=sys.stderr)
    os.write(1, b"raw fd write a0\\n")
    os.system("echo shell child a0")
    capture_output(job_dir, "trainer", 1, 1, opts)   # restarted in place: attempt 1
    print("python stdout a1")
    for i in range(100):
        print(f"line {i:03d} " + "x" * 40)
    sys.stdout.flush()
""")


@pytest.fixture
def logged(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "events.jsonl").write_text('{"ts": 1, "event": "job_started", "job": "j"}\n')
    res = subprocess.run([sys.executable, "-c", CHILD, str(job_dir)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return str(job_dir), res


def test_each_attempt_has_its_file(logged):
    job_dir, res = logged
    a0 = open(attempt_path(job_dir, "trainer", 1, 0)).read()
    for line in ("python stdout a0", "python stderr a0", "raw fd write a0", "shell child a0"):
        assert line in a0
    assert "a1" not in a0
    # the output still reaches the process's original stdout (Ray's worker log)
    assert "python stdout a0" in res.stdout and "python stdout a1" in res.stdout


def test_rotation_keeps_whole_lines_and_the_newest_parts(logged):
    job_dir, _ = logged
    live = attempt_path(job_dir, "trainer", 1, 1)
    parts = [live + ".2", live + ".1", live]
    assert all(os.path.exists(p) for p in parts)
    assert not os.path.exists(live + ".3")  # backups=2: older parts dropped
    for p in parts:
        size = os.path.getsize(p)
        assert size <= 2048
        assert open(p).read().endswith("\n")
    text = "".join(open(p).read() for p in parts)
    assert text.endswith("line 099 " + "x" * 40 + "\n")
    nums = [int(ln[5:8]) for ln in text.splitlines() if ln.startswith("line ")]
    assert nums == list(range(nums[0], 100))  # consecutive up to the last line


def test_rotating_file_refuses_tiny_limits(tmp_path):
    with pytest.raises(ValueError, match="max_bytes=10"):
        RotatingFile(str(tmp_path / "x.log"), max_bytes=10)


def test_dlrover_logs_one_instance_marks_attempts(logged, capsys):
    job_dir, _ = logged
    assert main(["logs", "j", "--job-dir", job_dir, "--role", "trainer", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert out.index("==> trainer-1 attempt 0 <==") < out.index("python stdout a0") \
        < out.index("==> trainer-1 attempt 1 <==") < out.index("python stdout a1")
    assert main(["logs", "j", "--job-dir", job_dir, "--role", "trainer", "--rank", "1",
                 "--attempt", "0"]) == 0
    out = capsys.readouterr().out
    assert "a0" in out and "python stdout a1" not in out


def test_dlrover_logs_several_instances_prefix_lines(logged, capsys):
    job_dir, _ = logged
    other = attempt_path(job_dir, "trainer", 0, 0)
    os.makedirs(os.path.dirname(other))
    with open(other, "w") as f:
        f.write("rank zero here\n")
    assert main(["logs", "j", "--job-dir", job_dir]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "[trainer-0 a0] rank zero here" in out
    assert "[trainer-1 a0] python stdout a0" in out
    assert "[trainer-1 a1] python stdout a1" in out
    assert [s.label for s in find_sources(job_dir)] == ["trainer-0", "trainer-1", "trainer-1"]


def test_unknown_instance_is_a_clear_error(logged, capsys):
    job_dir, _ = logged
    assert main(["logs", "j", "--job-dir", job_dir, "--role", "critic"]) == 2
    err = capsys.readouterr().err
    assert "no worker logs" in err and "role=critic" in err and "trainer-1" in err


def test_follow_prints_new_output_and_stops_when_the_job_ends(tmp_path):
    job_dir = str(tmp_path)
    path = attempt_path(job_dir, "trainer", 0, 0)
    os.makedirs(os.path.dirname(path))
    open(path, "w").write("before\n")

    class Sink:
        def __init__(self):
            self.text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    sink = Sink()
    t = threading.Thread(target=follow, args=(job_dir, "trainer", 0, None, sink, False),
                         kwargs={"poll_s": 0.05, "settle_s": 0.3, "timeout_s": 60})
    t.start()
    time.sleep(0.3)
    with open(path, "a") as f:
        f.write("after\n")
    p1 = attempt_path(job_dir, "trainer", 0, 1)
    time.sleep(0.3)
    open(p1, "w").write("restarted\n")
    time.sleep(0.3)
    (tmp_path / "summary.json").write_text("{}")
    t.join(30)
    assert not t.is_alive(), "follow did not stop after the job ended"
    assert sink.text.index("before") < sink.text.index("after") < \
        sink.text.index("==> trainer-0 attempt 1 <==") < sink.text.index("restarted")


def test_log_options_are_checked_before_anything_starts():
    from dlrover_core import load_spec
    from dlrover_core.spec.errors import SpecError

    base = {"name": "j", "roles": {"trainer": {"workload": "a.b:C"}}}
    o = load_spec({**base, "observability": {"log_max_bytes": 4096, "log_backups": 0,
                                             "worker_logs": False}}).observability
    assert (o.log_max_bytes, o.log_backups, o.worker_logs) == (4096, 0, False)
    with pytest.raises(SpecError, match=r"observability\.log_max_bytes: 100 is invalid; "
                                        r"allowed: bytes per log file >= 1024"):
        load_spec({**base, "observability": {"log_max_bytes": 100}})
    with pytest.raises(SpecError, match=r"observability\.log_backups: -1 is invalid; "
                                        r"allowed: an integer >= 0"):
        load_spec({**base, "observability": {"log_backups": -1}})


def test_a_jobs_log_options_reach_its_workers(ray_cluster, tmp_path):
    """A real one-rank job with ``log_max_bytes: 2048, log_backups: 1``: the rank's log
    is rotated at 2 KiB with one older part kept (the default would keep it whole)."""
    from dlrover_core import load_spec
    from dlrover_core.testing import run_job

    spec = {"name": "log-opts",
            "roles": {"trainer": {"workload": "tests.cli_workloads:Chatty", "total": 1,
                                  "backend": "ddp", "resources": {"cpu": 1}}},
            "observability": {"log_max_bytes": 2048, "log_backups": 1},
            "config": {"max_steps": 150, "step_s": 0.0}}
    job_dir = str(tmp_path / "job")
    summary = run_job(load_spec(spec), job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    live = attempt_path(job_dir, "trainer", 0, 0)
    assert os.path.exists(live + ".1") and not os.path.exists(live + ".2")
    assert all(os.path.getsize(p) <= 2048 for p in (live, live + ".1"))
    assert open(live).read().rstrip().splitlines()[-1].endswith("run() returned at step 149")


SPLIT_CHILD = textwrap.dedent("""
    import os, sys, time
    from dlrover_core.runtime import log_capture
    job_dir = sys.argv[1]
    log_capture.capture_output(job_dir, "trainer", 0, 0)
    fd, read = log_capture._capture._read_fd, os.read
    # the capture thread now reads the pipe 7 bytes at a time: every switch marker
    # (over 20 bytes) arrives split across reads
    os.read = lambda f, n: read(f, min(n, 7) if f == fd else n)
    print("attempt zero output", flush=True)
    first = log_capture.attempt_path(job_dir, "trainer", 0, 0)
    while "attempt zero output" not in open(first).read():  # that read was unpatched
        time.sleep(0.01)
    print("more of attempt zero", flush=True)
    t0 = time.monotonic()
    log_capture.capture_output(job_dir, "trainer", 0, 1)
    print(f"switch took {time.monotonic() - t0:.3f} s", file=sys.stderr, flush=True)
    print("attempt one output", flush=True)
    os.write(1, b"a NUL that is no marker: \\0dl\\n")
    log_capture.capture_output(job_dir, "trainer", 0, 2)
    print("attempt two output", flush=True)
""")


def test_a_switch_marker_split_across_reads_is_found(tmp_path):
    """A real child process whose capture thread reads 7 bytes at a time (os.read
    patched for the capture's pipe only): each attempt's output lands in its own file,
    whole, and no marker byte lands in any."""
    job_dir = str(tmp_path)
    res = subprocess.run([sys.executable, "-c", SPLIT_CHILD, job_dir], capture_output=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    files = [open(attempt_path(job_dir, "trainer", 0, a), "rb").read() for a in range(3)]
    assert files[0] == b"attempt zero output\nmore of attempt zero\n"
    assert files[1].startswith(b"switch took ")  # stderr shares the file
    assert files[1].split(b"\n", 1)[1] == b"attempt one output\na NUL that is no marker: \0dl\n"
    assert files[2] == b"attempt two output\n"
    assert b"dlrover-log-switch" not in res.stdout
