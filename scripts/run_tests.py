"""`make test`: every test suite (the core's and each plugin's), two at a time.

Run one after another, the suites leave a 2-core machine about 40 % idle (they mostly
wait for processes, Ray actors and clusters to start), so two at once take about two
thirds of the time. Every suite runs, even after one failed; the exit status is 1 when
any failed.

    [SLOW=1] python scripts/run_tests.py --plugins "PLUGIN_DIRS" [--order "NAMES"] [-- PYTEST_ARGS...]

The suites form one queue, longest first as far as known, and two lanes each take the
next suite from it whenever they are free (Graham's list scheduling: the lanes end at
most one suite's length apart, whatever the machine's speed; fixed lanes drifted apart
as suites grew). The queue: the core's tests, then the plugins, those named in
``--order`` in that order (the longest first) after any plugin it does not name (a new
plugin starts early, its length unknown).
Without SLOW=1 (`make test`), the tests marked `slow` (long scenarios: multi-node
clusters, restarts, the full examples) are left out of every suite. With SLOW=1
(`make test SLOW=1`, what .ci/run runs), every test runs: first the slow tests of the
files named in ``--slow-first`` as one suite (the long harnesses, one after the other:
run at once they starve each other), the core's tests not marked slow, then its other
slow tests in ``--slow-chunks`` suites of whole test files (a Ray cluster a module
shares stays in one process; files dealt out by their count of slow tests, the largest
first, to the chunk with the fewest; run as one suite in a lane of their own, they made
that lane end ever later than the other), then the plugins. Each suite's log ends with
its 15 slowest tests (``--durations=15``).

Each suite's output goes to a log under ``--logs`` (default ``.test-logs/``, replaced by
each run; ``NN-name.log``, NN its place in the queue), printed whole when the lanes
end; after them, each failed suite's exit status and pytest's short summary of its
failures (or its log's last lines), where a reader of only the output's tail sees them;
while a suite runs, its pytest progress (percent done, failures so far) is printed
every ``--progress-s`` seconds.

Ctrl-C (SIGINT), SIGTERM or SIGHUP stops the run: every running suite gets SIGINT in its
own process group (pytest stops and runs its fixtures' teardown, which shuts its Ray
cluster down), whatever still runs after ``--grace-s`` seconds is SIGKILLed with its
process group (Ray's processes started by ``ray.init`` die with their driver), no further
suite starts, the runner says which suites ran and where their logs are, and exits 130
(128 + the signal number, as a shell does). A second Ctrl-C kills at once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

# a pytest -q progress line: outcome letters, then "[ NN%]" once the line is full or ends
_PROGRESS = re.compile(r"^([.FEsxXp]+)(?:\s+\[\s*(\d+)%\])?\s*$")
# make test's budget: the two lanes within 10 minutes on a 2-core machine (setup apart)
_BUDGET_S = 600


@dataclass
class Suite:
    """One pytest run: ``name`` (as printed), ``log`` (its output file), ``args``."""

    name: str
    log: str
    args: list[str]
    state: str = "not started"  # not started | running | exit N | interrupted
    rc: int | None = None
    seconds: float = 0.0
    proc: subprocess.Popen | None = field(default=None, repr=False)


def progress(log: str) -> tuple[int, int, int | None]:
    """``(tests done, failed or errored so far, percent done or None)`` read from the
    outcome letters of a pytest -q log (pytest prints the percentage only at the end of
    a line of letters, so the count of letters is the finer figure)."""
    done = failed = 0
    pct = None
    try:
        with open(log, errors="replace") as f:
            for line in f:
                m = _PROGRESS.match(line)
                if m:
                    done += len(m.group(1))
                    failed += m.group(1).count("F") + m.group(1).count("E")
                    if m.group(2) is not None:
                        pct = int(m.group(2))
    except OSError:
        pass
    return done, failed, pct


class Runner:
    def __init__(self, py: str, logs: str, progress_s: float, grace_s: float):
        self.py, self.logs = py, logs
        self.progress_s, self.grace_s = progress_s, grace_s
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.suites: list[Suite] = []  # the queue, in order
        self.taken = 0  # how many of it a lane has taken
        self.signum: int | None = None

    def say(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)

    def run_suite(self, s: Suite) -> None:
        t0 = time.monotonic()
        with self.lock:
            if self.stop.is_set():
                return
            s.state = "running"
            log = open(s.log, "wb")
            # its own session: a Ctrl-C on the terminal reaches the runner only, and the
            # runner stops each suite with its whole process group
            s.proc = subprocess.Popen(
                [self.py, "-m", "pytest", "-q", *s.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            log.close()
        self.say(f"== {s.name}: started")
        last = time.monotonic()
        shown = None
        while s.proc.poll() is None:
            time.sleep(0.5)
            if time.monotonic() - last >= self.progress_s:
                last = time.monotonic()
                done, failed, pct = progress(s.log)
                if done and (done, failed) != shown:
                    shown = (done, failed)
                    of = f" (over {pct} %)" if pct is not None else ""
                    self.say(f"== {s.name}: {done} tests done{of}, {failed} failed so far")
        s.rc = s.proc.returncode
        s.seconds = time.monotonic() - t0
        s.state = "interrupted" if self.stop.is_set() else f"exit {s.rc}"
        tail = _last_line(s.log)
        self.say(f"== {s.name}: {s.state} after {s.seconds:.0f} s: {tail}")

    def lane(self) -> None:
        """Run the next suite of the queue nobody took, until none is left or a stop."""
        while True:
            with self.lock:
                if self.stop.is_set() or self.taken >= len(self.suites):
                    return
                s = self.suites[self.taken]
                self.taken += 1
            self.run_suite(s)

    def interrupt(self, signum, _frame) -> None:
        if self.stop.is_set():  # a second Ctrl-C: kill at once
            self._kill_all(signal.SIGKILL)
            return
        self.signum = signum
        with self.lock:
            self.stop.set()
        print(
            f"\n== {signal.Signals(signum).name}: stopping the running suites "
            f"(SIGKILL after {self.grace_s:.0f} s; Ctrl-C again to kill now)",
            flush=True,
        )
        self._kill_all(signal.SIGINT)
        threading.Thread(target=self._kill_later, daemon=True).start()

    def _kill_later(self) -> None:
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline:
            if all(s.proc is None or s.proc.poll() is not None for s in self.suites):
                return
            time.sleep(0.2)
        self._kill_all(signal.SIGKILL)

    def _kill_all(self, sig: int) -> None:
        for s in self.suites:
            if s.proc is not None:
                try:
                    os.killpg(s.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


def _log_lines(path: str) -> list[str] | None:
    """The log's lines that are not blank (right-stripped); ``None`` when it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return [ln.rstrip() for ln in f if ln.strip()]
    except OSError:
        return None


def _last_line(path: str) -> str:
    lines = _log_lines(path)
    return "(no log)" if lines is None else lines[-1] if lines else "(no output)"


def digest(path: str, limit: int = 30) -> list[str]:
    """What a failed suite's log says of its failures, for the end of the run's output
    (CI shows the output's head and tail; a failed suite's log in the middle is cut):
    pytest's "short test summary info" section (its FAILED and ERROR lines and the final
    count) when the log has one, else the log's last lines (a suite that crashed or
    was killed); at most ``limit`` lines, the last ones kept."""
    lines = _log_lines(path)
    if lines is None:
        return ["(no log)"]
    head = next((i for i in range(len(lines) - 1, -1, -1)
                 if "short test summary info" in lines[i]), None)
    part = lines[head + 1:] if head is not None else lines
    return part[-limit:] if part else ["(no output)"]


def print_failures(suites: list[Suite]) -> None:
    """Each failed suite's name, state, time and log, then its :func:`digest`."""
    for s in suites:
        print(f"== {s.name}: {s.state} after {s.seconds:.0f} s ({os.path.basename(s.log)}):")
        for line in digest(s.log):
            print(f"   {line}")


def slow_files(py: str, core: str, extra: list[str]) -> dict[str, int] | None:
    """``{test file: its count of tests marked slow}`` of the core's suite, from pytest's
    own collection (``--collect-only -m slow``, in a child: the runner imports no test);
    None when the collection failed (an import error: the suite then reports it) or a
    file pytest names cannot be found (the caller then runs the slow tests as one suite)."""
    r = subprocess.run([py, "-m", "pytest", "-q", "--collect-only", "-m", "slow", core, *extra],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode not in (0, 5):  # 5: no test collected
        return None
    counts: dict[str, int] = {}
    for line in r.stdout.splitlines():
        if "::" not in line:
            continue
        f = line.split("::", 1)[0]
        # a node id is relative to pytest's rootdir: here (an ini file in the working
        # directory) or the core's directory (none)
        path = next((c for c in (f, os.path.join(core, f)) if os.path.isfile(c)), None)
        if path is None:
            return None
        counts[path] = counts.get(path, 0) + 1
    return counts


def deal(counts: dict[str, int], chunks: int) -> list[list[str]]:
    """Test files dealt into at most ``chunks`` groups: the file with the most tests first,
    each to the group with the fewest so far (Graham's longest-processing-time rule, with
    the count of tests for a file's length); the groups largest first, empty ones left
    out, each group's files sorted."""
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(max(1, chunks))]
    for f in sorted(counts, key=lambda f: (-counts[f], f)):
        i = min(range(len(groups)), key=lambda i: (groups[i][0], i))
        groups[i] = (groups[i][0] + counts[f], [*groups[i][1], f])
    return [sorted(fs) for n, fs in sorted(groups, key=lambda g: -g[0]) if fs]


def plan(logs: str, core: str, plugins: list[str], slow: bool, extra: list[str],
         order: list[str] = (), slow_chunks: int = 8, py: str = sys.executable,
         slow_first: list[str] = ()) -> list[Suite]:
    """The queue of suites (see the module docstring); with ``slow``, the slow tests of
    the files ``slow_first`` (paths as pytest names them) form one suite at the head of
    the queue."""
    only = [] if slow else ["-m", "not slow"]
    # each log then says where the time went (CI's run is near its 90 minutes; `make
    # test`'s near its 10)
    extra = ["--durations=15", *extra]
    queue: list[tuple[str, str, list[str]]] = []  # (name, log's stem, pytest args)
    if slow:
        counts = slow_files(py, core, extra)
        named = {os.path.abspath(f) for f in slow_first}
        first = sorted(f for f in (counts or {}) if os.path.abspath(f) in named)
        if first:
            queue.append(("core (slow, first)", "core-slow-first", [*first, "-m", "slow", *extra]))
        queue.append(("core", "core", [core, "-m", "not slow", *extra]))
        rest = {f: n for f, n in (counts or {}).items() if f not in first}
        groups = deal(rest, slow_chunks) if counts is not None else [[core]]
        for i, files in enumerate(groups, 1):
            name = f"core (slow {i}/{len(groups)})" if len(groups) > 1 else "core (slow)"
            queue.append((name, f"core-slow-{i}", [*files, "-m", "slow", *extra]))
    else:
        queue.append(("core", "core", [core, *only, *extra]))

    def rank(p: str) -> tuple[int, int]:
        name = os.path.basename(p.rstrip("/"))
        return (1, order.index(name)) if name in order else (0, 0)

    for p in sorted(plugins, key=rank):  # stable: unnamed plugins keep their order
        p = p.rstrip("/") + "/"
        name = os.path.basename(p.rstrip("/"))
        queue.append((p, name, [f"{p}tests", "--rootdir", p, "-c", f"{p}pyproject.toml",
                                *only, *extra]))
    return [Suite(name, f"{logs}/{i:02d}-{stem}.log", args)
            for i, (name, stem, args) in enumerate(queue, 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    ap.add_argument("--plugins", default="", help="plugin directories, space-separated")
    ap.add_argument("--order", default="",
                    help="plugin names, space-separated, the longest suite first: their "
                         "place in the queue, after the plugins not named")
    ap.add_argument("--slow-chunks", type=int, default=8,
                    help="with SLOW=1: the core's slow tests run as this many suites")
    ap.add_argument("--slow-first", default="",
                    help="with SLOW=1: core test files, space-separated, whose slow tests run "
                         "as one suite at the head of the queue (long tests that must not "
                         "run at the same time as each other)")
    ap.add_argument("--lanes", type=int, default=2, help="suites run at once")
    ap.add_argument("--core", default="tests", help="the core's test directory")
    ap.add_argument("--logs", default=".test-logs", help="where each suite's log goes")
    ap.add_argument("--progress-s", type=float, default=30.0,
                    help="seconds between progress lines of a running suite")
    ap.add_argument("--grace-s", type=float, default=10.0,
                    help="after Ctrl-C, seconds before the suites still running are SIGKILLed")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest")
    a = ap.parse_args(argv)
    slow = os.environ.get("SLOW", "") == "1"
    shutil.rmtree(a.logs, ignore_errors=True)
    os.makedirs(a.logs)
    if a.lanes < 1 or a.slow_chunks < 1:
        ap.error(f"--lanes ({a.lanes}) and --slow-chunks ({a.slow_chunks}) must be 1 or more")
    t0 = time.monotonic()
    r = Runner(a.python, a.logs, a.progress_s, a.grace_s)
    r.suites = plan(a.logs, a.core, a.plugins.split(), slow, a.pytest_args, a.order.split(),
                    a.slow_chunks, a.python, a.slow_first.split())
    print(f"== {len(r.suites)} suites, {a.lanes} at a time: "
          + ", ".join(s.name for s in r.suites), flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, r.interrupt)
    threads = [threading.Thread(target=r.lane) for _ in range(a.lanes)]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():  # join with a timeout: the main thread keeps taking signals
            t.join(0.5)
    elapsed = time.monotonic() - t0
    if r.signum is not None:
        print(f"== interrupted after {elapsed:.0f} s", flush=True)
        for s in r.suites:
            where = f": {s.log}" if s.state != "not started" else ""
            print(f"   {s.name}: {s.state}{where}")
        print(f"== logs: {os.path.abspath(a.logs)}")
        # the suites that had failed before the stop: what they say (the end of CI's
        # output is the part it keeps when its time runs out)
        print_failures([s for s in r.suites if s.state.startswith("exit") and s.rc not in (0, 5)])
        return 128 + r.signum
    for s in r.suites:
        print(f"================ {os.path.basename(s.log)[:-4]}")
        with open(s.log, errors="replace") as f:
            sys.stdout.write(f.read())
    print(f"the lanes ended after {elapsed:.0f} s")
    failed = [s for s in r.suites if s.rc not in (0, 5)]  # 5: no test collected
    print(f"== logs: {os.path.abspath(a.logs)}")
    if failed:
        print_failures(failed)
        print("FAILED suites:", " ".join(s.name for s in failed))
        return 1
    print("every suite passed")
    if not slow and elapsed > _BUDGET_S:
        print(f"make test's lanes took {elapsed:.0f} s, over their 10 minutes: mark the "
              "tests of 25 s or more `slow` (each log above ends with its slowest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
