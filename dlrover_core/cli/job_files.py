"""Reading a job directory (``runs/<name>/``) for the commands that look at jobs after
the fact: one run's ``summary.json``, ``events.jsonl`` and ``metrics.jsonl`` (the latest
run by default; where each run's files are: :func:`dlrover_core.runs.run_paths`).

Each reader tolerates a job that is still running (no summary yet, a torn last line).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from dlrover_core.master.events import read_events
from dlrover_core.runs import EVENTS, METRICS, RUN_INFO, SUMMARY, run_paths

__all__ = ["EVENTS", "METRICS", "SUMMARY", "AmbiguousJobError", "JobFiles", "JobRef",
           "add_job_arguments", "find_job", "is_job_dir", "job_name_of", "resolve_job_dir"]


def run_option(text: str) -> str:
    """argparse ``type`` of ``--run``: ``N``, ``run-N`` or ``latest``, checked here so a
    bad value is a usage error (exit 2) naming the forms allowed."""
    import argparse

    from dlrover_core.runs import parse_run

    try:
        parse_run(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_job_arguments(parser, run: bool = True) -> None:
    """Add the arguments of a command that reads a job directory after the fact to
    ``parser`` (an ``argparse.ArgumentParser``): ``job`` (a job name or a job
    directory), ``--job-dir`` and, with ``run``, ``--run`` (:func:`run_option`); the
    values go to :func:`resolve_job_dir` and :meth:`JobFiles.read`."""
    parser.add_argument("job", help="job name (runs/NAME) or a job directory")
    parser.add_argument("--job-dir", default=None,
                        help="the job directory (default runs/NAME)")
    if run:
        parser.add_argument("--run", default=None, type=run_option,
                            help="which run of the job directory (N or run-N; default: "
                                 "the latest)")


class AmbiguousJobError(LookupError):
    """A job name matches several job directories (the message lists them)."""


def is_job_dir(path: str) -> bool:
    """``path`` holds a run of a job (a ``run.json`` or an ``events.jsonl``)."""
    return os.path.isfile(os.path.join(path, RUN_INFO)) or os.path.isfile(
        os.path.join(path, EVENTS))


def job_name_of(job_dir: str) -> str:
    """The name of the job whose latest run is in ``job_dir``: from ``run.json``, else
    ``summary.json``, else the first event, else the directory's name."""
    for f in (RUN_INFO, SUMMARY):
        try:
            with open(os.path.join(job_dir, f)) as fh:
                name = json.load(fh).get("name")
            if name:
                return str(name)
        except (OSError, ValueError, AttributeError):
            pass
    events = read_events(os.path.join(job_dir, EVENTS))
    if events and events[0].get("job"):
        return str(events[0]["job"])
    return os.path.basename(os.path.normpath(job_dir))


@dataclass(frozen=True)
class JobRef:
    """A job found by :func:`find_job`: its ``name`` (its JobMaster's name) and its
    ``job_dir`` (absolute)."""

    name: str
    job_dir: str


def find_job(job: str, job_dir: str | None = None, root: str = "runs",
             running: dict[str, str] | None = None) -> JobRef:
    """The one rule by which ``status``, ``logs``, ``timeline`` and ``stop`` find a job.

    1. ``job_dir`` (``--job-dir``) when given;
    2. else ``job`` when it is a job directory (a path holding a run);
    3. else ``job`` is a name: every job directory under ``root`` named ``job`` or
       holding a job named ``job``; when there is none, the directory of the running job
       named ``job`` (``running``: job name -> job directory of the JobMasters alive).
       Exactly one must match.

    Raises:
        FileNotFoundError: nothing matches (the message says where it looked).
        AmbiguousJobError: several directories match (the message lists them).
    """
    if job_dir:
        if not is_job_dir(job_dir):
            raise FileNotFoundError(f"--job-dir {os.path.abspath(job_dir)!r} holds no run of a "
                                    f"job (no {RUN_INFO} or {EVENTS})")
        d = os.path.abspath(job_dir)
        return JobRef(job_name_of(d), d)
    if is_job_dir(job):
        d = os.path.abspath(job)
        return JobRef(job_name_of(d), d)
    found: dict[str, str] = {}  # job directory -> job name
    if os.path.isdir(root):
        for entry in sorted(os.listdir(root)):
            d = os.path.abspath(os.path.join(root, entry))
            if os.path.isdir(d) and is_job_dir(d):
                name = job_name_of(d)
                if job in (entry, name):
                    found[d] = name
    if running and job in running and running[job] and not found:
        # a running job of the joined cluster counts only when no directory under
        # ``root`` matches: a job of that name elsewhere (another root, another user's
        # runs on a shared cluster) never makes a local name ambiguous
        found[os.path.abspath(running[job])] = job
    if len(found) == 1:
        (d, name), = found.items()
        return JobRef(name, d)
    if found:
        listed = "; ".join(f"{d} (job {n!r})" for d, n in sorted(found.items()))
        raise AmbiguousJobError(
            f"job {job!r} is ambiguous: it matches {len(found)} job directories: {listed}; "
            "name one of them (a path) or pass --job-dir DIR")
    raise FileNotFoundError(
        f"job {job!r}: no job directory named {job!r} or holding a job of that name under "
        f"{os.path.abspath(root)!r}" + (" and no running job of that name" if running is not
                                         None else "")
        + "; pass a job directory (the path `dlrover submit --job-dir` wrote)")


def resolve_job_dir(job: str, job_dir: str | None = None, root: str = "runs") -> str:
    """The directory of ``job`` by :func:`find_job`'s rule (no running jobs asked).

    Raises:
        FileNotFoundError, AmbiguousJobError: as :func:`find_job`.
    """
    return find_job(job, job_dir, root).job_dir


@dataclass
class JobFiles:
    """What one run of a job directory holds. ``summary`` is ``None`` while it runs;
    ``run`` is the run's number."""

    job_dir: str
    summary: dict | None = None
    events: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)  # the "step" records of metrics.jsonl
    run: int = 1

    @classmethod
    def read(cls, job_dir: str, run: str | int | None = None) -> JobFiles:
        """Run ``run`` of ``job_dir`` (default: the latest).

        Raises:
            FileNotFoundError: no such run (see :func:`dlrover_core.runs.run_paths`).
        """
        paths = run_paths(job_dir, run)
        summary = None
        if os.path.exists(paths.summary):
            try:
                with open(paths.summary) as f:
                    summary = json.load(f)
            except ValueError:
                summary = None  # being replaced right now; atomic writes make this rare
        return cls(job_dir, summary, read_events(paths.events),
                   [r for r in read_events(paths.metrics) if r.get("event") == "step"],
                   paths.run)

    @property
    def name(self) -> str:
        if self.summary and self.summary.get("name"):
            return str(self.summary["name"])
        for e in self.events:
            if e.get("event") == "job_started" and e.get("job"):
                return str(e["job"])
        return os.path.basename(os.path.normpath(self.job_dir))

    def first(self, event: str) -> dict | None:
        return next((e for e in self.events if e.get("event") == event), None)

    def last(self, event: str) -> dict | None:
        return next((e for e in reversed(self.events) if e.get("event") == event), None)

    def all(self, event: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == event]
