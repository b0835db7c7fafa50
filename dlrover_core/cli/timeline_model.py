"""The data ``dlrover timeline`` draws, built from a job directory's ``events.jsonl``
and ``metrics.jsonl`` (times are seconds since ``job_started``).

- one **row** per role instance (``role``, ``rank``; the driver as role ``driver``)
  with its **attempts**: ``[start, end)`` from ``instance_started`` to the instance's
  failure, its next start (a restart in place), its finish or the end of the job, and
  how each ended (``exit``: see :class:`Attempt`);
- **failures** (``instance_failed``, with the level ``failure_classified`` gave),
  **recoveries** (``recovery_started`` to ``recovery_finished``, with their level),
  **checkpoints** (``checkpoint_saved``: step and the time the loop was blocked),
  **tuning** versions (``tuning_applied``, ``tuning_reverted``);
- the **steps** rank 0 reported over time. A script role (``roles.R.command``, backend
  ``torchrun``) reports them when its script calls ``dlrover_core.script_api.report_step``
  (and its checkpoints with ``report_checkpoint``, which ``FlashCheckpointer.save``
  calls); a script that does not has no steps, and its rows' attempts, with how each
  ended, are the whole record (``script_roles`` names the script roles);
- the **goodput breakdown** of the wall time, in seconds: ``startup`` (job start to the
  first step), ``recovery`` (sum of recovery spans), ``checkpoint`` (sum of blocking
  save time), ``productive`` (goodput x wall time, goodput as in ``summary.json``:
  unique steps x median step time / wall time, after DLRover's goodput), and ``other``
  (the rest: steps redone after a restart, waits). A job whose script roles report no
  steps (no ``report_step``) has no goodput: its start-up ends at the first
  ``instance_started`` and the scripts' run time is ``other`` (productive and redone
  work cannot be told apart).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import asdict, dataclass, field

from dlrover_core.cli.job_files import JobFiles

DRIVER = "driver"
#: the backend every script role has: ``dlrover_core.runtime.script.SCRIPT_BACKEND``, not
#: imported (it imports Ray); tests/test_timeline_script_roles.py checks they agree
SCRIPT_BACKEND = "torchrun"
GOODPUT_PARTS = ("productive", "startup", "recovery", "checkpoint", "other")


@dataclass
class Attempt:
    start: float
    end: float
    attempt: int
    outcome: str  # "failed", "finished", "restarted", "stopped" (the job ended) or "running"
    #: how it ended, short: a failure's kind (``node_lost``, ``actor_died``, ...) or, for
    #: a script role, its script's ``exit code N`` / ``signal NAME (N)``; ``exit code 0``
    #: (a script) or ``finished``; ``<level> recovery`` (restarted by it; a survivor's
    #: ``survivor_abort`` text when the recovery reports one, e.g. ``script stopped
    #: (SIGTERM)``); ``job ended``; ``""`` while running
    exit: str = ""


@dataclass
class Row:
    role: str
    rank: int
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.role if self.role == DRIVER else f"{self.role}-{self.rank}"


@dataclass
class FailureMark:
    t: float
    role: str
    rank: int
    kind: str
    level: str
    step: int
    message: str


@dataclass
class RecoverySpan:
    start: float
    end: float
    level: str
    seconds: float


@dataclass
class CheckpointMark:
    t: float
    step: int
    blocking_s: float


@dataclass
class TuningMark:
    t: float
    version: int
    event: str  # "applied" or "reverted"


@dataclass
class Timeline:
    """Everything the timeline figure shows; ``as_dict`` is ``dlrover timeline --json``."""

    name: str
    status: str
    wall_s: float
    rows: list[Row]
    failures: list[FailureMark]
    recoveries: list[RecoverySpan]
    checkpoints: list[CheckpointMark]
    tuning: list[TuningMark]
    steps: list[tuple[float, int]]  # (t, step) of rank 0's reports, in report order
    goodput: float | None
    breakdown: dict[str, float]  # GOODPUT_PARTS -> seconds, summing to wall_s
    script_roles: list[str] = field(default_factory=list)  # roles that run a command

    def row_index(self, role: str, rank: int) -> int:
        for i, r in enumerate(self.rows):
            if r.role == role and (r.rank == rank or role == DRIVER):
                return i
        raise KeyError(f"no row for {role}-{rank}")

    def as_dict(self) -> dict:
        d = asdict(self)
        for r, row in zip(d["rows"], self.rows):
            r["label"] = row.label
        return d


def _goodput_from_steps(step_ts: dict[int, float], wall: float) -> float | None:
    """Unique steps x median step time / wall time (the formula of ``summary.json``)."""
    if wall <= 0 or len(step_ts) < 3:
        return None
    ts = [step_ts[s] for s in sorted(step_ts)]
    gaps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
    if not gaps:
        return None
    return min(1.0, len(step_ts) * statistics.median(gaps) / wall)


_SCRIPT_EXIT = re.compile(r"ended with (exit code -?\d+|signal \w+ \(\d+\))")


def _failed_exit(e: dict, script: bool) -> str:
    """``exit code 3`` / ``signal SIGKILL (9)`` from a script's ``ScriptExitError``
    message; else the failure's kind."""
    m = _SCRIPT_EXIT.search(str(e.get("message", ""))) if script else None
    return m.group(1) if m else str(e.get("kind", "") or "failed")


def build_timeline(files: JobFiles) -> Timeline:
    """The :class:`Timeline` of a job directory's files.

    Raises:
        ValueError: ``events.jsonl`` has no ``job_started`` event.
    """
    started = files.first("job_started")
    if started is None:
        raise ValueError(f"{files.job_dir}: events.jsonl has no job_started event")
    t0 = float(started["ts"])
    finished = files.last("job_finished")
    end_ts = float(finished["ts"]) if finished else max(
        [float(e["ts"]) for e in files.events] + [float(s["ts"]) for s in files.steps])
    wall = end_ts - t0
    status = (files.summary or {}).get("status") or (finished or {}).get("status") or "running"

    def rel(e: dict) -> float:
        return round(float(e["ts"]) - t0, 6)

    role_info = started.get("roles") or {}
    order = list(role_info.keys())
    scripts = [r for r, info in role_info.items()
               if (info or {}).get("backend") == SCRIPT_BACKEND]
    rows: dict[tuple[str, int], Row] = {}
    open_attempt: dict[tuple[str, int], Attempt] = {}
    levels = iter([e.get("level", "") for e in files.all("failure_classified")])
    failures, recoveries, checkpoints, tuning = [], [], [], []
    rec_start: dict | None = None
    level = ""  # of the newest failure_classified: the level of the recovery it starts
    restarted: dict[str, Attempt] = {}  # label -> attempt ended by the open recovery
    for e in files.events:
        ev = e.get("event")
        key = (str(e.get("role", "")), int(e.get("rank", 0) or 0))
        if ev == "instance_started":
            row = rows.setdefault(key, Row(*key))
            prev = open_attempt.pop(key, None)
            if prev is not None:
                prev.end, prev.outcome = rel(e), "restarted"
                prev.exit = f"{(rec_start or {}).get('level') or level or 'a'} recovery"
                restarted[row.label] = prev
            att = Attempt(rel(e), wall, int(e.get("attempt", 0) or 0), "running")
            row.attempts.append(att)
            open_attempt[key] = att
        elif ev in ("instance_failed", "instance_finished"):
            att = open_attempt.pop(key, None)
            script = key[0] in scripts
            if att is not None:
                att.end = rel(e)
                if ev == "instance_failed":
                    att.outcome, att.exit = "failed", _failed_exit(e, script)
                else:
                    att.outcome, att.exit = "finished", ("exit code 0" if script
                                                         else "finished")
            if ev == "instance_failed":
                failures.append(FailureMark(rel(e), key[0], key[1], str(e.get("kind", "")),
                                            next(levels, ""), int(e.get("step", -1)),
                                            str(e.get("message", ""))[:200]))
        elif ev == "failure_classified":
            level = str(e.get("level", ""))
        elif ev == "recovery_started":
            rec_start, restarted = e, {}
        elif ev == "recovery_finished":
            aborts = (e.get("phases") or {}).get("survivor_abort") or {}
            for label, att in restarted.items():
                if isinstance(aborts.get(label), str) and aborts[label]:
                    att.exit = aborts[label][:80]
            restarted = {}
            if rec_start is not None:
                recoveries.append(RecoverySpan(
                    rel(rec_start), rel(e), str(e.get("level") or rec_start.get("level", "")),
                    float(e.get("seconds", rel(e) - rel(rec_start)))))
                rec_start = None
        elif ev == "checkpoint_saved":
            checkpoints.append(CheckpointMark(rel(e), int(e.get("step", -1)),
                                              float(e.get("blocking_s", 0.0))))
        elif ev in ("tuning_applied", "tuning_reverted"):
            tuning.append(TuningMark(rel(e), int(e.get("version", 0)), ev.split("_", 1)[1]))
    if rec_start is not None:  # still recovering
        recoveries.append(RecoverySpan(rel(rec_start), wall, str(rec_start.get("level", "")),
                                       wall - rel(rec_start)))
    for att in open_attempt.values():
        att.outcome = "running" if finished is None else "stopped"
        att.exit = "" if finished is None else "job ended"

    def sort_key(r: Row) -> tuple:
        pos = order.index(r.role) if r.role in order else len(order) + (r.role == DRIVER)
        return (pos, r.role, r.rank)

    step_role = files.steps[0]["role"] if files.steps else None
    steps = [(round(float(s["ts"]) - t0, 6), int(s["step"])) for s in files.steps
             if s.get("role") == step_role]
    step_ts: dict[int, float] = {}
    for t, s in steps:
        step_ts.setdefault(s, t)
    goodput = (files.summary or {}).get("goodput")
    if goodput is None:
        goodput = _goodput_from_steps(step_ts, wall)
    first_step = min(step_ts.values()) if step_ts else wall
    if not step_ts and scripts:  # no steps: start-up ends when the first script starts
        first_step = min((a.start for r in rows.values() for a in r.attempts), default=wall)
    recovery = sum(r.end - r.start for r in recoveries)
    # a recovery before the first step counts as recovery, not start-up
    startup = max(0.0, first_step - sum(max(0.0, min(r.end, first_step) - r.start)
                                        for r in recoveries))
    checkpoint = sum(c.blocking_s for c in checkpoints)
    rest = max(0.0, wall - startup - recovery - checkpoint)
    productive = min(rest, (goodput or 0.0) * wall)
    breakdown = {"productive": productive, "startup": startup, "recovery": recovery,
                 "checkpoint": checkpoint, "other": max(0.0, rest - productive)}
    return Timeline(files.name, status, wall, sorted(rows.values(), key=sort_key), failures,
                    recoveries, checkpoints, tuning, steps, goodput,
                    {k: round(v, 4) for k, v in breakdown.items()}, scripts)
