"""``dlrover diagnose JOB [--job-dir DIR] [--json]``: what went wrong in a job's latest
run, from its job directory: how it ended (status and error); each failure (the
instance, the step it had reported, the error, how it was classified and what was
restarted) with the last lines of the failed instance's log; the pre-flight node checks
(one table per check: a row per node with its GFLOP/s, its all-gather bus bandwidth per
round and its verdict), the stragglers found while it ran and the hangs with the files
holding the stuck ranks' stacks."""

from __future__ import annotations

import argparse
import os

from rich.markup import escape

from dlrover_core.cli.job_files import add_job_arguments
from dlrover_core.cli.output import console_for, print_json, print_table

VERDICT_STYLE = {"ok": "green", "unverified": "yellow", "failed": "red",
                 "slow_compute": "red", "slow_network": "red"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="node checks, stragglers and hangs of a job "
                       "(from its job directory)")
    add_job_arguments(p, run=False)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_diagnose)


#: lines of a failed instance's log that ``diagnose`` prints
LOG_TAIL_LINES = 15


def failures(events: list[dict], job_dir: str, tail: int = LOG_TAIL_LINES) -> list[dict]:
    """One dict per ``instance_failed`` event of ``events``: its fields, the
    ``failure_classified`` event that followed it (``level``, ``reason``,
    ``classifier``), the ``recovery_started`` one (``recovery``: its level and roles)
    and ``log`` / ``log_tail``: the failed attempt's log file under ``job_dir`` and its
    last ``tail`` lines (``[]`` when there is none)."""
    from dlrover_core.cli.jobs_list import tail_lines
    from dlrover_core.runtime.log_capture import attempt_path

    out: list[dict] = []
    for i, e in enumerate(events):
        if e.get("event") != "instance_failed":
            continue
        f = {k: e.get(k) for k in ("ts", "role", "rank", "attempt", "step", "phase", "kind",
                                  "exc_type", "message", "node_id")}
        for later in events[i + 1:]:
            if later.get("event") == "instance_failed":
                break
            if later.get("event") == "failure_classified" and "level" not in f:
                f.update(level=later.get("level"), reason=later.get("reason"),
                         classifier=later.get("classifier"))
            if later.get("event") == "recovery_started" and "recovery" not in f:
                f["recovery"] = {"level": later.get("level"), "roles": later.get("roles")}
        log = None
        if f["role"] is not None and f["attempt"] is not None:
            log = attempt_path(job_dir, str(f["role"]), int(f["rank"] or 0), int(f["attempt"]))
        f["log"] = log if log and os.path.exists(log) else None
        f["log_tail"] = tail_lines(f["log"])[-tail:] if f["log"] else []
        out.append(f)
    return out


def diagnosis(events: list[dict]) -> dict:
    """``{"node_checks", "skipped", "kept", "stragglers", "hangs"}``: the ``node_check``,
    ``node_check_skipped``, ``node_check_kept``, ``straggler_detected`` and
    ``hang_stacks`` events, in order."""
    pick = {"node_check": "node_checks", "node_check_skipped": "skipped",
            "node_check_kept": "kept",
            "straggler_detected": "stragglers", "hang_stacks": "hangs"}
    out: dict[str, list[dict]] = {v: [] for v in pick.values()}
    for e in events:
        if e.get("event") in pick:
            out[pick[e["event"]]].append(e)
    return out


def _bw(node: dict, rnd: int) -> str:
    parts = []
    for p in node.get("pairs", []):
        if p["round"] != rnd:
            continue
        peer = p["peer"][:8]
        parts.append(f"{p['busbw_gbps']:.3f} (w/ {peer})" if p["ok"] else f"failed (w/ {peer})")
    return ", ".join(parts) or "-"


def cmd_diagnose(args: argparse.Namespace) -> int:
    from dlrover_core.cli.job_files import JobFiles, resolve_job_dir

    files = JobFiles.read(resolve_job_dir(args.job, args.job_dir))
    found = diagnosis(files.events)
    found["failures"] = failures(files.events, files.job_dir)
    found["summary"] = {k: (files.summary or {}).get(k) for k in ("status", "error", "steps")}
    stacks = os.path.join(files.job_dir, "stacks")
    found["stacks_dir"] = stacks if os.path.isdir(stacks) and os.listdir(stacks) else None
    if args.json:
        print_json(found)
        return 0
    _print_failures(files, found)
    for e in found["skipped"]:
        print(f"{files.name}: node check skipped: {e['reason']}")
    if not found["node_checks"] and not found["skipped"]:
        print(f"{files.name}: no node check (skipped, or no role with a process group)")
    for i, check in enumerate(found["node_checks"], 1):
        rows = []
        for n in check["nodes"]:
            style = VERDICT_STYLE.get(n["verdict"], "white")
            rows.append((n["node_id"][:12], n.get("ip", ""),
                         "-" if n["gflops"] is None else f"{n['gflops']:.2f}",
                         _bw(n, 1), _bw(n, 2), f"[{style}]{n['verdict']}[/]",
                         n.get("reason", "")))
        print_table(("node", "ip", "GFLOP/s", "all-gather GB/s round 1", "round 2",
                     "verdict", "reason"), rows,
                    title=f"{files.name}: node check {i} ({check['seconds']:.1f} s, "
                          f"excluded {len(check['excluded'])})")
    for e in found["kept"]:
        print(f"kept despite the check: {', '.join(n[:12] for n in e['nodes'])}: {e['reason']}")
    if found["stragglers"]:
        print_table(("time", "rank", "node", "step", "compute x others", "action"),
                    ((_hms(e["ts"]), f"{e['role']}-{e['rank']}", e["node_id"][:12],
                      e["step"], f"{e['ratio']:.2f}", e["action"])
                     for e in found["stragglers"]), title="stragglers")
    if found["hangs"]:
        print_table(("time", "blamed", "stacks"),
                    ((_hms(e["ts"]), e["blamed"],
                      "\n".join(f"{k}: {v}" for k, v in e["files"].items())
                      or "; ".join(f"{k}: {v}" for k, v in e["errors"].items()))
                     for e in found["hangs"]), title="hangs")
    return 0


def _print_failures(files, found: dict) -> None:
    """How the run ended, then each failure with the tail of its log."""
    console = console_for()
    summ = found["summary"]
    state = summ["status"] or "running, or ended without a summary"
    console.print(f"{files.name} run {files.run}: {state}"
                  + (f" after {summ['steps']} steps" if summ["steps"] is not None else ""),
                  markup=False, highlight=False)
    if summ["error"]:
        console.print("[bold red]error:[/] " + escape(str(summ["error"]).strip().splitlines()[0]
                                                     if summ["error"].strip() else ""),
                      highlight=False)
    if not found["failures"]:
        console.print("no failure of any instance", highlight=False)
    for f in found["failures"]:
        step = f["step"]
        after = (f"after step {step}" if isinstance(step, int) and step >= 0
                 else "before its first reported step")
        msg = (str(f["message"] or "").strip().splitlines() or [""])[0][:300]
        what = f"{f['exc_type'] or f['kind']}: {msg}" if msg else str(f["exc_type"] or f["kind"])
        console.print(f"\n[bold]{escape(str(f['role']))}-{f['rank']} attempt {f['attempt']}[/] "
                      f"failed {after} ({escape(str(f['phase'] or '?'))}): {escape(what)}",
                      highlight=False)
        if f.get("level"):
            rec = f.get("recovery") or {}
            console.print(f"  classified {escape(str(f['level']))} by "
                          f"{escape(str(f.get('classifier')))}: {escape(str(f.get('reason')))}"
                          + (f"; restarted at {rec.get('level')} level: "
                             f"{', '.join(rec.get('roles') or [])}" if rec else ""),
                          highlight=False)
        if f["log"]:
            console.print(f"  last lines of {f['log']}:", highlight=False, markup=False)
            for line in f["log_tail"]:
                console.print("    " + line, highlight=False, markup=False)
        else:
            console.print("  (no log: worker_logs off, or it never started)", highlight=False)
    if found["stacks_dir"]:
        console.print(f"\nstacks saved (hangs, failures): {found['stacks_dir']}", highlight=False,
                      markup=False)
    console.print("")


def _hms(ts: float) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(ts))
