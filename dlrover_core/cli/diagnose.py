"""``dlrover diagnose JOB [--job-dir DIR] [--json]``: the node health of a job, from its
job directory: the pre-flight node checks (one table per check: a row per node with
its GFLOP/s, its all-gather bus bandwidth per round and its verdict), the stragglers
found while it ran and the hangs with the files holding the stuck ranks' stacks."""

from __future__ import annotations

import argparse

from dlrover_core.cli.job_files import add_job_arguments
from dlrover_core.cli.output import print_json, print_table

VERDICT_STYLE = {"ok": "green", "unverified": "yellow", "failed": "red",
                 "slow_compute": "red", "slow_network": "red"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="node checks, stragglers and hangs of a job "
                       "(from its job directory)")
    add_job_arguments(p, run=False)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=cmd_diagnose)


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
    if args.json:
        print_json(found)
        return 0
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


def _hms(ts: float) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(ts))
