"""``dlrover logs JOB [--role R] [--rank K] [--attempt N] [-f] [--job-dir DIR] [--run N]``:
the stdout/stderr of role instances of one run (the latest by default), from the job
directory (``logs/<role>-<rank>/attempt-<N>.log`` and its rotated parts, see
:mod:`dlrover_core.runtime.log_capture`; an earlier run's under ``run-<N>/logs/``), so it
works while the job runs, after it ended and after a master restart. With ``--address``
the same path is also read on every alive node of that Ray cluster (one Ray task per
node, :mod:`dlrover_core.cli.remote_logs`), so ranks of other nodes show without a shared
file system; each attempt is printed from the longest copy found.

The output starts with a ``=== run 2 of nanogpt (started ...) ===`` header. One
instance: its attempts in order, each under a ``==> trainer-1 attempt 0 <==`` line.
Several: every line prefixed with ``[trainer-1 a0]``. ``-f`` keeps printing what is
appended (new attempts included) until the run's ``summary.json`` appears and nothing
more is written for ``--settle`` seconds, or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Iterable

from dlrover_core.cli.job_files import add_job_arguments
from dlrover_core.runs import SUMMARY
from dlrover_core.runtime.log_capture import LOGS_DIR

if TYPE_CHECKING:
    from dlrover_core.runs import RunPaths

_ATTEMPT_RE = re.compile(r"^attempt-(\d+)\.log$")
_ROTATED_RE = re.compile(r"^attempt-(\d+)\.log\.(\d+)$")


@dataclass(frozen=True)
class LogSource:
    """One attempt of one instance: ``label`` (``trainer-1``/``driver``), ``role``,
    ``rank`` (-1 for the driver), ``attempt``, and its ``path`` (the live file)."""

    label: str
    role: str
    rank: int
    attempt: int
    path: str

    def parts(self) -> list[str]:
        """Rotated parts, oldest first, then the live file (those that exist)."""
        d, base = os.path.split(self.path)
        rotated = []
        for name in os.listdir(d) if os.path.isdir(d) else []:
            m = _ROTATED_RE.match(name)
            if m and int(m.group(1)) == self.attempt:
                rotated.append((int(m.group(2)), os.path.join(d, name)))
        out = [p for _, p in sorted(rotated, reverse=True)]
        return out + ([self.path] if os.path.exists(self.path) else [])


def _split_label(label: str) -> tuple[str, int]:
    role, sep, rank = label.rpartition("-")
    if sep and rank.isdigit():
        return role, int(rank)
    return label, -1


def find_sources(job_dir: str, role: str | None = None, rank: int | None = None,
                 attempt: int | None = None) -> list[LogSource]:
    """The attempts logged under ``job_dir`` matching the filters, ordered by role,
    rank and attempt."""
    base = os.path.join(job_dir, LOGS_DIR)
    out = []
    for label in os.listdir(base) if os.path.isdir(base) else []:
        r, k = _split_label(label)
        if (role is not None and r != role) or (rank is not None and k != rank):
            continue
        attempts = set()
        for name in os.listdir(os.path.join(base, label)):
            m = _ATTEMPT_RE.match(name) or _ROTATED_RE.match(name)
            if m:
                attempts.add(int(m.group(1)))
        for a in sorted(attempts):
            if attempt is None or a == attempt:
                out.append(LogSource(label, r, k, a, os.path.join(base, label,
                                                                  f"attempt-{a}.log")))
    return sorted(out, key=lambda s: (s.role, s.rank, s.attempt))


class Printer:
    """Writes log bytes to ``out``: headers for one instance, prefixes for several."""

    def __init__(self, out: IO[str], prefixed: bool) -> None:
        self.out, self.prefixed = out, prefixed
        self._current: LogSource | None = None
        self._partial: dict[LogSource, str] = {}

    def write(self, src: LogSource, data: bytes) -> None:
        text = self._partial.pop(src, "") + data.decode(errors="replace")
        if not self.prefixed:
            if src != self._current:
                self.out.write(f"==> {src.label} attempt {src.attempt} <==\n")
                self._current = src
            self.out.write(text)
            return
        lines = text.split("\n")
        if lines[-1]:
            self._partial[src] = lines[-1]
        for ln in lines[:-1]:
            self.out.write(f"[{src.label} a{src.attempt}] {ln}\n")

    def finish(self) -> None:
        for src, rest in self._partial.items():
            self.out.write(f"[{src.label} a{src.attempt}] {rest}\n")
        self._partial.clear()
        self.out.flush()


def read_local(job_dir: str, role: str | None = None, rank: int | None = None,
               attempt: int | None = None) -> dict[tuple[str, int], bytes]:
    """``{(label, attempt): bytes}`` of the matching attempt logs under ``job_dir`` as
    this machine sees it (rotated parts first, then the live file, concatenated). Run
    on every node of a cluster by ``dlrover logs --address``."""
    out = {}
    for src in find_sources(job_dir, role, rank, attempt):
        data = b""
        for part in src.parts():
            try:
                with open(part, "rb") as f:
                    data += f.read()
            except OSError:  # rotated or removed while reading
                continue
        out[(src.label, src.attempt)] = data
    return out


def cluster_sources(job_dir: str, role: str | None, rank: int | None,
                    attempt: int | None) -> tuple[list[tuple[LogSource, bytes]], list[str]]:
    """The matching attempts as every alive node of the connected Ray cluster and this
    machine see ``job_dir`` (:func:`dlrover_core.cli.remote_logs.read_cluster`): one
    ``(LogSource, bytes)`` per attempt, the longest copy, ordered by role, rank and
    attempt; and the nodes that did not answer."""
    from dlrover_core.cli.remote_logs import read_cluster

    found, problems = read_cluster(read_local, job_dir, role, rank, attempt)
    best = {key: data for key, (data, _) in found.items()}
    for key, data in read_local(job_dir, role, rank, attempt).items():
        if len(data) > len(best.get(key, b"")) or key not in best:
            best[key] = data
    out = []
    for (label, att), data in best.items():
        r, k = _split_label(label)
        path = os.path.join(job_dir, LOGS_DIR, label, f"attempt-{att}.log")
        out.append((LogSource(label, r, k, att, path), data))
    return sorted(out, key=lambda s: (s[0].role, s[0].rank, s[0].attempt)), problems


def print_logs(sources: Iterable[LogSource], out: IO[str], prefixed: bool) -> None:
    """Print everything logged so far by ``sources`` (rotated parts first)."""
    printer = Printer(out, prefixed)
    for src in sources:
        for part in src.parts():
            with open(part, "rb") as f:
                printer.write(src, f.read())
    printer.finish()


class LogTail:
    """What is appended to the matching logs of ``job_dir``, attempts and rotation
    included: :meth:`poll` prints the new bytes through a :class:`Printer`."""

    def __init__(self, job_dir: str, out: IO[str], prefixed: bool, role: str | None = None,
                 rank: int | None = None, attempt: int | None = None,
                 from_start: bool = True) -> None:
        self.job_dir, self.role, self.rank, self.attempt = job_dir, role, rank, attempt
        self.out = out
        self.printer = Printer(out, prefixed)
        self.offsets: dict[LogSource, int] = {}
        for src in find_sources(job_dir, role, rank, attempt):
            if from_start:
                for part in src.parts():
                    with open(part, "rb") as f:
                        self.printer.write(src, f.read())
            self.offsets[src] = os.path.getsize(src.path) if os.path.exists(src.path) else 0
        out.flush()

    def poll(self) -> bool:
        """Print what was appended since the last call; True when there was some."""
        wrote = False
        for src in find_sources(self.job_dir, self.role, self.rank, self.attempt):
            pos = self.offsets.get(src, 0)
            size = os.path.getsize(src.path) if os.path.exists(src.path) else 0
            if size < pos:  # rotated: the rest of the old file is now part .1
                rotated = src.path + ".1"
                if os.path.exists(rotated):
                    with open(rotated, "rb") as f:
                        f.seek(pos)
                        self.printer.write(src, f.read())
                pos = 0
            if size > pos:
                with open(src.path, "rb") as f:
                    f.seek(pos)
                    data = f.read()
                self.printer.write(src, data)
                pos += len(data)
                wrote = True
            self.offsets[src] = pos
        self.out.flush()
        return wrote

    def finish(self) -> None:
        self.printer.finish()


def follow(job_dir: str, role: str | None, rank: int | None, attempt: int | None,
           out: IO[str], prefixed: bool, poll_s: float = 0.5, settle_s: float = 2.0,
           timeout_s: float | None = None) -> None:
    """Print what is appended to the matching logs until the job ended (its
    ``summary.json`` exists) and nothing was written for ``settle_s`` s, or
    ``timeout_s`` s passed."""
    tail = LogTail(job_dir, out, prefixed, role, rank, attempt)
    start = quiet_since = time.time()
    while True:
        wrote = tail.poll()
        now = time.time()
        if wrote:
            quiet_since = now
        ended = os.path.exists(os.path.join(job_dir, SUMMARY))
        if ended and now - quiet_since >= settle_s:
            break
        if timeout_s is not None and now - start >= timeout_s:
            break
        time.sleep(poll_s)
    tail.finish()


def run_header(run: RunPaths) -> str:
    """``=== run 2 of nanogpt (started 2026-11-25 02:40:11) ===``: the line that starts
    the logs of one run."""
    info = run.info
    name = info.get("name") or os.path.basename(run.job_dir)
    started = ""
    if info.get("started_at"):
        started = time.strftime(" (started %Y-%m-%d %H:%M:%S)",
                                time.localtime(float(info["started_at"])))
    return f"=== run {run.run} of {name}{started} ==="


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logs", help="stdout/stderr of role instances, every attempt, from "
                       "the job directory")
    add_job_arguments(p)
    p.add_argument("--role", default=None, help="only this role ('driver' for the driver)")
    p.add_argument("--rank", type=int, default=None, help="only this rank")
    p.add_argument("--attempt", type=int, default=None, help="only this attempt (0: first)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing new output until the job ends")
    p.add_argument("--address", default=None,
                   help="read the logs on every node of this Ray cluster (HOST:PORT or "
                        "auto) as well as here: no shared file system needed")
    p.set_defaults(func=cmd_logs)


def cmd_logs(args: argparse.Namespace) -> int:
    from dlrover_core.cli.job_files import resolve_job_dir
    from dlrover_core.cli.output import console_for

    from dlrover_core.runs import run_paths

    try:
        root = resolve_job_dir(args.job, args.job_dir)
    except FileNotFoundError:
        if args.address is None:
            raise
        root = _job_dir_on_cluster(args)  # not on this machine: the nodes may have it
    run = run_paths(root, args.run)
    job_dir = run.dir  # the run's files: find_sources/follow read <dir>/logs
    remote: dict[LogSource, bytes] | None = None
    if args.address is not None:
        if args.follow:
            console_for(stderr=True).print("--follow reads this machine's job directory "
                                           "only; leave out --address", highlight=False)
            return 2
        from dlrover_core.cli.remote_logs import connect

        connect(args.address)
        found, problems = cluster_sources(job_dir, args.role, args.rank, args.attempt)
        for problem in problems:
            console_for(stderr=True).print(f"no logs from {problem}", highlight=False)
        remote = dict(found)
        sources = list(remote)
    else:
        sources = find_sources(job_dir, args.role, args.rank, args.attempt)
    labels = {s.label for s in sources}
    if not sources and not args.follow:
        what = ", ".join(f"{k}={v}" for k, v in (("role", args.role), ("rank", args.rank),
                                                  ("attempt", args.attempt)) if v is not None)
        have = sorted({s.label for s in find_sources(job_dir)})
        where = "the cluster's nodes or " if remote is not None else ""
        console_for(stderr=True).print(
            f"no worker logs in {where}{os.path.join(job_dir, LOGS_DIR)}"
            + (f" for {what}" if what else "")
            + (f"; logged instances: {', '.join(have)}" if have else ""), highlight=False)
        return 2
    sys.stdout.write(run_header(run) + "\n")
    single = (args.role is not None and args.rank is not None) or args.role == "driver"
    prefixed = len(labels) > 1 or (args.follow and not single)
    if args.follow:
        try:
            follow(job_dir, args.role, args.rank, args.attempt, sys.stdout, prefixed)
        except KeyboardInterrupt:
            pass
        return 0
    if remote is not None:
        printer = Printer(sys.stdout, prefixed)
        for src in sources:
            printer.write(src, remote[src])
        printer.finish()
        return 0
    print_logs(sources, sys.stdout, prefixed)
    return 0


def _job_dir_on_cluster(args: argparse.Namespace) -> str:
    """The job directory of ``args.job`` when this machine has none: ``--job-dir`` as
    given, else ``runs/<job>`` under the current directory, as the nodes name it."""
    return os.path.abspath(args.job_dir or os.path.join("runs", args.job))
