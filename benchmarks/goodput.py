"""Goodput under repeated faults: the nanogpt job (2 workers, FSDP2 or DDP) runs for
``--minutes``, and every ``--every-s`` seconds trainer rank 1's process is SIGKILLed.

    .venv/bin/python benchmarks/goodput.py                      # 10 minutes, a kill every 60 s
    .venv/bin/python benchmarks/goodput.py --backend ddp --runs 3   # DDP: ranks heal, no step redone
    .venv/bin/python benchmarks/goodput.py --minutes 3 --every-s 45 --saver disk --ckpt-every 10

Goodput (DLRover's definition) = productive training time / wall time, where productive
time = unique steps completed x the median step time (the master's ``summary.json``):
recovery, steps redone from the last checkpoint and start-up count against it. With
``--backend ddp`` a replaced rank heals from the survivor's live state
(``dlrover_core.checkpoint.heal``), so no step is redone; with ``fsdp`` the ranks reload
the newest checkpoint (``--saver``, every ``--ckpt-every`` steps).

The last line of output is one JSON object: ``goodput`` (0..1), ``steps_redone`` and
``faults`` (kills made), each a number for one run or ``{"median", "min", "max",
"runs": [...]}`` over ``--runs``; ``runs`` holds every run's figures (``wall_s``,
``steps``, ``restarts``, ``status``, ``recovery_s_median``: kill to the first step after
it, ``master_recovery_s``) and where the wall time went (``breakdown_s``,
``step_s_median``, ``step_s_mean``, ``kill_gaps_s``: see :func:`where_lost`).
With ``--no-fault-runs N``, N runs of the same job and length with no kill follow:
``goodput_no_fault`` (as ``goodput``), ``goodput_vs_no_fault`` (the median goodput over
the median without faults: what the faults themselves cost; ``None`` when either has no
figure) and ``no_fault_runs``.
The harness polls the master's status every ``--poll-s`` (0.25 s; it polled every
0.05 s before 2026-12-01, about 2 % of a core of this driver at nice 0 and the
master's answers, taken from the ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from recovery import analyse, run_job, start_ray  # noqa: E402

BACKENDS = ("fsdp", "ddp")


def one_run(args: argparse.Namespace, ckpt_every: int, faults: bool = True) -> dict:
    """One job of ``args.minutes`` with a SIGKILL of rank 1 every ``args.every_s`` s
    (``faults=False``: none, the same job otherwise)."""
    import ray

    temp = start_ray()
    job_dir = tempfile.mkdtemp(prefix="goodput-")
    wall_target = args.minutes * 60
    kills = [{"at_s": t} for t in
             [args.every_s * i for i in range(1, int(wall_target // args.every_s) + 1)]
             if t < wall_target - 5] if faults else []
    over = ["name=bench-goodput", "config.max_steps=1000000", "config.eval_every=1000000",
            f"roles.trainer.backend={args.backend}",
            f"checkpoint.saver={args.saver}", f"checkpoint.every_steps={ckpt_every}",
            "checkpoint.keep=2", "failover.max_restarts=1000", "failover.max_node_failures=1000"]
    if args.persist_every is not None:
        over.append(f"checkpoint.options.persist_every_steps={args.persist_every}")
    try:
        out = run_job(over, job_dir, kills, poll_s=args.poll_s, timeout_s=wall_target)
        a = analyse(job_dir, out["kill_ts"])
        lost = where_lost(job_dir, out["kill_ts"])
    finally:
        if not args.keep:
            shutil.rmtree(job_dir, ignore_errors=True)
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    s = out["summary"] or {}
    return {
        "goodput": s.get("goodput"), "faults": len(out["kill_ts"]), "wall_s": s.get("wall_s"),
        "steps": s.get("steps"), "restarts": (s.get("restarts") or {}).get("total"),
        "status": s.get("status"), "steps_redone": a["steps_redone"],
        "recovery_s_median": round(statistics.median(a["recovery_s"]), 3)
        if a["recovery_s"] else None,
        "master_recovery_s": a["master_recovery_s"], **lost,
        **({"job_dir": job_dir} if args.keep else {}),
    }


def where_lost(job_dir: str, kill_ts: list[float]) -> dict:
    """Where a run's wall time went, from its job directory: ``breakdown_s`` (the
    ``dlrover timeline`` breakdown: productive, startup, recovery, checkpoint, other; s)
    and the steady steps' spread, since goodput counts each unique step at the *median*
    step time: ``step_s_median`` and ``step_s_mean`` of the gaps between consecutive
    steps of rank 0 with no kill inside them (s), and ``kill_gaps_s``, the sum of the
    gaps that hold a kill (s: the step a kill interrupts and the recovery after it)."""
    from dlrover_core.cli.job_files import JobFiles
    from dlrover_core.cli.timeline_model import build_timeline

    files = JobFiles.read(job_dir)
    tl = build_timeline(files)
    first: dict[int, float] = {}
    for t, step in tl.steps:
        first.setdefault(step, t)
    t0 = float(files.first("job_started")["ts"])   # the timeline's zero
    kills = [k - t0 for k in kill_ts]
    gaps = [(first[s + 1] - first[s], any(first[s] <= k < first[s + 1] for k in kills))
            for s in sorted(first) if s + 1 in first]   # (seconds, holds a kill)
    steady = [g for g, killed in gaps if not killed]
    held = [g for g, killed in gaps if killed]
    return {"breakdown_s": {k: round(v, 2) for k, v in tl.breakdown.items()},
            "step_s_median": round(statistics.median(steady), 4) if steady else None,
            "step_s_mean": round(statistics.fmean(steady), 4) if steady else None,
            "kill_gaps_s": round(sum(held), 3)}


def _numbers(runs: list[dict], key: str) -> list[float]:
    """The runs' ``key`` values that are numbers (a run without a summary has ``None``)."""
    return [v for v in (r.get(key) for r in runs) if isinstance(v, (int, float))]


def median_of(runs: list[dict], key: str) -> float | None:
    """The median of the runs' ``key`` (``None`` values left out; ``None`` if none)."""
    xs = _numbers(runs, key)
    return statistics.median(xs) if xs else None


def over_runs(runs: list[dict], key: str) -> object:
    """``key`` of the one run, or ``{"median", "min", "max", "runs"}`` over several
    (``None`` values left out of the median, kept in ``runs``)."""
    if len(runs) == 1:
        return runs[0].get(key)
    xs = _numbers(runs, key)
    return {"median": median_of(runs, key), "min": min(xs, default=None),
            "max": max(xs, default=None), "runs": [r.get(key) for r in runs]}


def main(argv: list[str] | None = None) -> int:
    from dlrover_core.plugins.manager import get_plugin_manager

    default_saver = "flash" if "flash" in get_plugin_manager().savers() else "disk"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every-s", type=float, default=60.0)
    ap.add_argument("--backend", default="fsdp", help=f"one of {', '.join(BACKENDS)}")
    ap.add_argument("--runs", type=int, default=1, help="jobs run one after another (>= 1)")
    ap.add_argument("--saver", default=default_saver)
    ap.add_argument("--keep", action="store_true",
                    help="keep each run's job directory (events, metrics) and print it")
    ap.add_argument("--ckpt-every", type=int, default=None,
                    help="steps between checkpoints (default: 1 for flash, 10 for disk)")
    ap.add_argument("--persist-every", type=int, default=None,
                    help="flash only: write every N-th saved step to the checkpoint directory "
                         "(checkpoint.options.persist_every_steps; default: the saver's, 1)")
    ap.add_argument("--no-fault-runs", type=int, default=0,
                    help="then this many runs of the same job and length with no kill: the "
                         "goodput this machine allows without faults (start-up, the steps' "
                         "spread), reported as goodput_no_fault and goodput_vs_no_fault")
    ap.add_argument("--poll-s", type=float, default=0.25,
                    help="s between the harness's status polls of the master (a kill lands "
                         "within this of its time; each poll is CPU of this driver and the "
                         "master taken from the ranks)")
    args = ap.parse_args(argv)
    if args.no_fault_runs < 0:
        ap.error(f"--no-fault-runs={args.no_fault_runs}; allowed: an integer >= 0")
    if args.poll_s <= 0:
        ap.error(f"--poll-s={args.poll_s}; allowed: a number of seconds > 0")
    if args.persist_every is not None and (args.saver != "flash" or args.persist_every < 1):
        ap.error(f"--persist-every={args.persist_every}: allowed with --saver flash only, "
                 "an integer >= 1")
    if args.backend not in BACKENDS:
        ap.error(f"--backend={args.backend!r}; allowed: {', '.join(BACKENDS)}")
    if args.runs < 1:
        ap.error(f"--runs={args.runs}; allowed: an integer >= 1")
    ckpt_every = args.ckpt_every or (1 if args.saver == "flash" else 10)
    runs = []
    for i in range(args.runs):
        runs.append(one_run(args, ckpt_every))
        print(f"run {i + 1}/{args.runs}:", json.dumps(runs[-1]), flush=True)
    calm = []
    for i in range(args.no_fault_runs):
        calm.append(one_run(args, ckpt_every, faults=False))
        print(f"no-fault run {i + 1}/{args.no_fault_runs}:", json.dumps(calm[-1]), flush=True)
    extra: dict = {}
    if calm:
        extra["goodput_no_fault"] = over_runs(calm, "goodput")
        med, med_calm = median_of(runs, "goodput"), median_of(calm, "goodput")
        extra["goodput_vs_no_fault"] = round(med / med_calm, 4) if med and med_calm else None
        extra["no_fault_runs"] = calm
    result = {"goodput": over_runs(runs, "goodput"),
              "steps_redone": over_runs(runs, "steps_redone"),
              "faults": over_runs(runs, "faults"), "backend": args.backend,
              "saver": args.saver, "ckpt_every": ckpt_every,
              "persist_every": args.persist_every, "minutes": args.minutes,
              "every_s": args.every_s, "poll_s": args.poll_s, "runs": runs, **extra}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
