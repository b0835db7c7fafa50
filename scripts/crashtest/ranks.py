"""The rank process of a phase: arm the crash point (or the trace), open the saver of
the run's case, run the phase's operations, journal each one, report each over a pipe.

An operation that raises ends the rank's phase (a training process would die of it);
the error goes to the journal and to the harness. WARNING records of every logger are
collected (a load that skipped a step must say so)."""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

from crashtest.journal import Journal, blank_state, digest, state_for


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"{record.name}: {record.getMessage()}"[:300])
        except Exception:  # a record that cannot be formatted is still a report
            self.lines.append(f"{record.name}: {record.msg}"[:300])


def case_module(saver: str) -> Any:
    """The case module of ``saver`` (``disk``, ``flash``, ``odl``)."""
    import importlib

    return importlib.import_module(f"crashtest.{saver}_case")


def _run_op(case: Any, saver: Any, spec: dict, op: tuple) -> dict:
    rank = spec["rank"]
    if op[0] == "save":
        return case.save(saver, spec, op[1], state_for(rank, op[1])) or {}
    if op[0] == "load":
        got = blank_state()
        # the harness's self-test fakes a wrong resume with force_load_step
        want = op[1] if op[1] is not None else spec.get("force_load_step")
        step = case.load(saver, spec, got, want)
        return {"step": step, "digest": digest(got) if step is not None else None,
                "source": getattr(saver, "last_load_source", None)}
    if op[0] == "wait":
        saver.wait()
        return {}
    if op[0] == "close":
        saver.close()
        return {}
    raise ValueError(f"unknown operation {op!r}")


def rank_main(conn: Any, spec: dict) -> None:
    """Run one rank's phase. ``spec``: ``saver``, ``rank``, ``world``, ``run_dir``,
    ``ckpt``, ``job``, ``phase``, ``ops``, ``arm`` (``{"name", "fault", "nth"}`` or
    ``None``), ``trace`` (a file or ``None``). Sends ``{"i", "op", "ok", ...}`` per
    operation, then ``{"done": True, "warnings": [...]}``."""
    import warnings as pywarnings

    from dlrover_core import crashpoints

    pywarnings.filterwarnings("ignore", category=UserWarning)  # DCP's single-process note
    os.environ.pop("DLROVER_CRASHPOINT", None)
    arm = spec.get("arm") or {}
    crashpoints.arm(arm.get("name"), arm.get("fault", "sigkill"), arm.get("nth", 1),
                    spec.get("trace"))
    warnings = _Warnings()
    logging.getLogger().addHandler(warnings)
    journal = Journal(os.path.join(spec["run_dir"], f"{spec['phase']}-rank{spec['rank']}.jsonl"))
    case = case_module(spec["saver"])
    saver = None
    try:
        case.setup_rank(spec)
        for i, op in enumerate(spec["ops"]):
            journal.write(i=i, op=op[0], arg=op[1] if len(op) > 1 else None, at="begin")
            try:
                if saver is None:
                    saver = case.make_saver(spec)
                out = _run_op(case, saver, spec, op)
            except BaseException as exc:  # noqa: BLE001 - every failure is the result
                error = f"{type(exc).__name__}: {exc}"[:500]
                journal.write(i=i, op=op[0], at="error", error=error)
                conn.send({"i": i, "op": op[0], "ok": False, "error": error,
                           "trace": traceback.format_exc()[-1500:]})
                break
            journal.write(i=i, op=op[0], at="end", **out)
            conn.send({"i": i, "op": op[0], "ok": True, **out})
        crashpoints.arm(None)
        conn.send({"done": True, "warnings": warnings.lines[:50], **case.rank_report(saver)})
    finally:
        crashpoints.arm(None)
        case.teardown_rank(spec)
