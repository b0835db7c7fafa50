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
from dlrover_core.runs import EVENTS, METRICS, SUMMARY, run_paths

__all__ = ["EVENTS", "METRICS", "SUMMARY", "JobFiles", "resolve_job_dir"]


def resolve_job_dir(job: str, job_dir: str | None = None, root: str = "runs") -> str:
    """The directory of ``job``: ``job_dir`` when given, ``job`` itself when it is a
    directory holding an ``events.jsonl``, else ``<root>/<job>``.

    Raises:
        FileNotFoundError: no such job directory (the message names where it looked).
    """
    candidates = [job_dir] if job_dir else [job, os.path.join(root, job)]
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, EVENTS)):
            return os.path.abspath(c)
    raise FileNotFoundError(
        f"job {job!r}: no job directory with an {EVENTS} at "
        + " or ".join(repr(os.path.abspath(c)) for c in candidates if c)
        + "; pass --job-dir DIR (the directory `dlrover submit --job-dir` wrote)")


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
