"""The runs of a job directory: each submit of a job is a *run* with a number (1, 2, ...).

Layout::

    <job_dir>/run.json          the latest run: {"run", "name", "started_at", "run_id",
                                "fresh"}
    <job_dir>/events.jsonl      the latest run's events, metrics, summary and worker logs
    <job_dir>/metrics.jsonl
    <job_dir>/summary.json
    <job_dir>/logs/
    <job_dir>/tensorboard/      (with ``observability.tensorboard: true``)
    <job_dir>/run-<N>/          an earlier run N: the same files, moved here when run N+1
                                began (and, after ``submit --fresh``, its ``ckpt/``)
    <job_dir>/ckpt/             checkpoints, shared by the runs: a new run resumes from them

The latest run stays at the top so that ``<job_dir>/summary.json`` is always the newest
result. :func:`run_paths` is the one place that says where a run's files are; every
reader (CLI, plugins, tests, benchmarks) goes through it. A job directory written before
runs existed (``events.jsonl`` but no ``run.json``) counts as run 1.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass

from dlrover_core.atomic_io import atomic_write_json
from dlrover_core.master.dir_lock import LOCK_NAME

RUN_INFO = "run.json"
EVENTS = "events.jsonl"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
LOGS = "logs"
#: what a run owns, moved to ``run-<N>/`` when the next run begins
RUN_FILES = (EVENTS, METRICS, SUMMARY, LOGS, RUN_INFO, "tensorboard")
ARCHIVE_PREFIX = "run-"


@dataclass(frozen=True)
class RunPaths:
    """Where one run's files are. ``run``: its number; ``dir``: the directory holding
    them (the job directory for the latest run, ``<job_dir>/run-<N>`` for an earlier
    one)."""

    job_dir: str
    run: int
    dir: str

    @property
    def events(self) -> str:
        return os.path.join(self.dir, EVENTS)

    @property
    def metrics(self) -> str:
        return os.path.join(self.dir, METRICS)

    @property
    def summary(self) -> str:
        return os.path.join(self.dir, SUMMARY)

    @property
    def logs(self) -> str:
        return os.path.join(self.dir, LOGS)

    @property
    def info(self) -> dict:
        """The run's ``run.json`` (``{}`` for a directory written before runs)."""
        return _read_json(os.path.join(self.dir, RUN_INFO)) or {}


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def latest_run(job_dir: str) -> int | None:
    """The number of the newest run in ``job_dir`` (``None``: no run yet)."""
    info = _read_json(os.path.join(job_dir, RUN_INFO))
    if info and isinstance(info.get("run"), int):
        return info["run"]
    if os.path.exists(os.path.join(job_dir, EVENTS)):  # written before runs existed
        return max(archived_runs(job_dir), default=0) + 1
    archived = archived_runs(job_dir)
    return archived[-1] if archived else None


def archived_runs(job_dir: str) -> list[int]:
    """Numbers of the earlier runs kept under ``run-<N>/``, ascending."""
    out = []
    for name in os.listdir(job_dir) if os.path.isdir(job_dir) else []:
        if name.startswith(ARCHIVE_PREFIX) and name[len(ARCHIVE_PREFIX):].isdigit():
            out.append(int(name[len(ARCHIVE_PREFIX):]))
    return sorted(out)


def list_runs(job_dir: str) -> list[int]:
    """Every run of ``job_dir``, oldest first."""
    runs = set(archived_runs(job_dir))
    latest = latest_run(job_dir)
    if latest is not None:
        runs.add(latest)
    return sorted(runs)


def parse_run(run: str | int | None) -> int | None:
    """``3``, ``"3"`` or ``"run-3"`` -> 3; ``None``/``"latest"`` -> ``None``.

    Raises:
        ValueError: anything else (the message names the value and the forms allowed).
    """
    if run is None or run == "latest":
        return None
    text = str(run)
    if text.startswith(ARCHIVE_PREFIX):
        text = text[len(ARCHIVE_PREFIX):]
    if not text.isdigit():
        raise ValueError(f"--run {run!r}: a run number (1, 2, ...), 'run-N' or 'latest'")
    return int(text)


def run_paths(job_dir: str, run: str | int | None = None) -> RunPaths:
    """Where run ``run`` of ``job_dir`` keeps its files (default: the latest run).

    Raises:
        FileNotFoundError: ``job_dir`` has no such run (the message lists its runs).
        ValueError: ``run`` is not a run number (see :func:`parse_run`).
    """
    job_dir = os.path.abspath(job_dir)
    number = parse_run(run)
    latest = latest_run(job_dir)
    if number is None or number == latest:
        return RunPaths(job_dir, latest or 1, job_dir)
    d = os.path.join(job_dir, f"{ARCHIVE_PREFIX}{number}")
    if not os.path.isdir(d):
        have = ", ".join(str(r) for r in list_runs(job_dir)) or "none"
        raise FileNotFoundError(f"{job_dir}: no run {number}; its runs: {have}")
    return RunPaths(job_dir, number, d)


def begin_run(job_dir: str, run_id: str = "", fresh: bool = False,
              checkpoint_dir: str | None = None, name: str = "") -> RunPaths:
    """Start a new run in ``job_dir``: move the previous run's files to ``run-<N>/``,
    with ``fresh`` also the checkpoints (what ``checkpoint_dir``, default
    ``<job_dir>/ckpt``, holds, to ``run-<N>/ckpt/``: kept, but not resumed from; the
    folder itself and its lock file stay), and write the new ``run.json``.

    Returns the new run's paths (number N + 1; 1 in a new directory).

    A ``checkpoint_dir`` URI of a remote protocol (not ``file://``) is left as it is:
    with ``fresh`` its checkpoints are not moved (:func:`~dlrover_core.master.client.
    submit` refuses that combination before the run starts).

    Raises:
        FileExistsError: ``run-<N>/`` already holds a file that would be moved there.
    """
    from dlrover_core.checkpoint.storage import local_path

    job_dir = os.path.abspath(job_dir)
    os.makedirs(job_dir, exist_ok=True)
    previous = latest_run(job_dir)
    present = [f for f in RUN_FILES if os.path.exists(os.path.join(job_dir, f))]
    ckpt = local_path(checkpoint_dir or os.path.join(job_dir, "ckpt"))
    ckpt = os.path.abspath(ckpt) if ckpt is not None else None
    # the folder stays (with the submit's lock file in it); what is in it moves
    held = [n for n in (os.listdir(ckpt) if fresh and ckpt and os.path.isdir(ckpt) else [])
            if n != LOCK_NAME]
    if present or held:
        archive = os.path.join(job_dir, f"{ARCHIVE_PREFIX}{previous or 0}")
        moves = [(os.path.join(job_dir, f), os.path.join(archive, f)) for f in present]
        moves += [(os.path.join(ckpt, n), os.path.join(archive, "ckpt", n)) for n in held]
        for _, dst in moves:
            if os.path.exists(dst):
                raise FileExistsError(f"cannot keep run {previous or 0}: {dst} exists already")
        os.makedirs(os.path.join(archive, "ckpt") if held else archive, exist_ok=True)
        for src, dst in moves:
            shutil.move(src, dst)
    number = max([previous or 0, *archived_runs(job_dir)]) + 1
    atomic_write_json(os.path.join(job_dir, RUN_INFO),
                      {"run": number, "name": name, "started_at": time.time(),
                       "run_id": run_id, "fresh": bool(fresh)})
    return RunPaths(job_dir, number, job_dir)


def read_summary(job_dir: str, run: str | int | None = None) -> dict | None:
    """The summary of run ``run`` of ``job_dir`` (default: the latest), or ``None``."""
    path = run_paths(job_dir, run).summary
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
