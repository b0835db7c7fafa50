"""How ``dlrover submit`` follows a running job: a progress bar (or plain lines), where
each role resumed from, the run's events that explain a failure (:class:`EventLines`) and,
with ``--verbose``, the workers' output, until the JobMaster has the job's summary."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from dlrover_core.runs import read_summary

def follow(master: Any, progress: bool = True, poll_s: float = 0.5,
           job_dir: str | None = None, verbose: bool = False) -> dict | None:
    """Poll the master until the job ends, drawing a progress bar; return the summary
    (read from ``job_dir`` when the master is gone, e.g. after ``dlrover stop``).

    ``verbose``: the workers' output, read from the job directory's logs as it is
    written (:class:`dlrover_core.cli.logs.LogTail`), to stderr, every line labelled
    ``[<role>-<rank> a<attempt>]`` (``[driver a0]``): every rank's lines, none merged
    (Ray's own stream of worker output is off, so nothing is de-duplicated or coloured).
    """
    from dlrover_core.cli.progress import JobProgress

    bar = JobProgress(enabled=progress)
    told: set[str] = set()
    tail = None
    with bar:
        if verbose and job_dir:
            from dlrover_core.cli.logs import LogTail

            tail = _Tail(LogTail, job_dir)
        try:
            return _follow_loop(master, bar, told, tail, poll_s, job_dir)
        finally:
            if tail is not None:
                tail.close()


class _Tail:
    """A :class:`~dlrover_core.cli.logs.LogTail` of a job directory's logs to stderr,
    made once the directory holds logs of the current run."""

    def __init__(self, cls: Any, job_dir: str) -> None:
        self.cls, self.job_dir, self.tail = cls, job_dir, None

    def poll(self) -> None:
        if self.tail is None:
            if not os.path.isdir(os.path.join(self.job_dir, "logs")):
                return
            self.tail = self.cls(self.job_dir, sys.stderr, prefixed=True)
        self.tail.poll()

    def close(self) -> None:
        self.poll()
        if self.tail is not None:
            self.tail.finish()


class EventLines:
    """The events of a run that explain what the console shows, read from its
    ``events.jsonl`` as they are written, one line each: a failed instance (with the
    step and the error's first line), a recovery's start and end, a warm standby that
    could not take over (and why). Ray's own lines (``(raylet) A worker died or was
    killed ...``) are then never the only explanation of a kill."""

    def __init__(self, path: str) -> None:
        self.path, self.offset = path, None

    def poll(self) -> list[str]:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        if self.offset is None or size < self.offset:
            self.offset = 0  # the first look, or a new run's file: from its start
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        out = []
        for raw in data[:end].splitlines():
            try:
                line = event_line(json.loads(raw))
            except ValueError:
                continue
            if line:
                out.append(line)
        return out


def event_line(e: dict) -> str | None:
    """The console line of event ``e`` (:class:`EventLines`), or ``None``."""
    kind = e.get("event")
    who = f"{e.get('role')}-{e.get('rank')}" if e.get("rank") is not None else e.get("role")
    if kind == "instance_failed":
        step = e.get("step")
        # ``step``: the last step it reported (the failure came after it)
        at = (f" after step {step}" if isinstance(step, int) and step >= 0
              else " before its first reported step")
        msg = str(e.get("message") or "").strip().splitlines()
        return (f"{who} failed{at}: {e.get('exc_type') or e.get('kind')}"
                + (f": {msg[0][:200]}" if msg else ""))
    if kind == "recovery_started":
        roles = ", ".join(e.get("roles") or []) or e.get("role")
        return f"recovering at {e.get('level')} level: {roles}"
    if kind == "recovery_finished":
        return f"recovered in {float(e.get('seconds') or 0):.1f} s ({e.get('level')} level)"
    if kind == "standby_unusable":
        reason = e.get("reason")
        why = ("none was ready" if reason == "none" else str(reason or "?").splitlines()[0])
        return (f"{e.get('role')}: the warm standby could not take over ({why}); a new "
                "process is started instead")
    return None


def _follow_loop(master: Any, bar: Any, told: set, tail: Any, poll_s: float,
                 job_dir: str | None) -> dict | None:
    import ray

    from dlrover_core.runs import run_paths

    events = EventLines(run_paths(job_dir).events) if job_dir else None
    while True:
        if tail is not None:
            tail.poll()
        for line in events.poll() if events is not None else []:
            bar.console.print(line, highlight=False, markup=False)
        try:
            st = ray.get(master.status.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            if _gone(master):
                return read_summary(job_dir) if job_dir else None
            time.sleep(poll_s)  # the master is restarting
            continue
        bar.update(st)
        for role, r in sorted((st.get("resumed_from") or {}).items()):
            if role not in told:
                told.add(role)
                bar.console.print(resume_line(st.get("run"), role, r), highlight=False,
                                  markup=False)
        if st["summary"] is not None:
            for line in events.poll() if events is not None else []:
                bar.console.print(line, highlight=False, markup=False)
            return st["summary"]
        time.sleep(poll_s)


def resume_line(run: int | None, role: str, resumed: dict) -> str:
    """``run 2: trainer resumed from step 8 (disk, checkpoint /.../trainer/step_00000008)``:
    where a run's role resumed from (``source``: ``memory``, ``disk``, ... as its saver
    says; the path is the step's directory, where a memory checkpoint is persisted)."""
    head = f"run {run}: " if run else ""
    return (f"{head}{role} resumed from step {resumed['step']} "
            f"({resumed.get('source') or 'unknown'}, checkpoint {resumed.get('path', '')})")


def _gone(master: Any) -> bool:
    """True when the master actor is dead for good (not restarting)."""
    import ray

    try:
        ray.get(master.status.remote(), timeout=30)
        return False
    except ray.exceptions.ActorDiedError:
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False  # unavailable for now: restarting
