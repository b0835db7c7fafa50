"""Straggler benchmark: a ``--ranks``-rank (default 2) gloo job, one rank slowed from outside to about
``--speed`` (default 40%) of its speed at step ``--slow-at`` by SIGSTOP/SIGCONT duty
cycling, with ``node_health.straggler_action`` (``--action``): ``replace`` (default:
the straggler is replaced from the warm standby; the ranks on one Ray node of
``ranks + 1`` CPUs) or ``shrink`` (an elastic role, ``nodes: "MIN:RANKS"``, one rank on
each node of a ``ray.cluster_utils.Cluster`` of 1 CPU per node: the straggler's node is
dropped and the role goes on with one rank less).

``--workload ddp`` (default): ``tests.node_health_workloads.DDPSteps``, a plain DDP loop
that times nothing itself (the ``ddp`` backend's all-reduce hook and the reporting
layer give the detector each rank's ``compute_s`` and ``comm_wait_s``, as in a user's
job); ``--workload sync``: ``SyncSteps``, a matmul loop that times its own
``compute_s`` outside its ``all_reduce``.

Figures, per run (the JSON line holds the median over ``--runs`` runs):

- ``detected_after_s``: from the start of the slowdown (the duty cycle's first
  SIGSTOP) to the first ``straggler_detected`` event after it;
- ``throughput_healthy``: samples/s (rank 0's step reports in ``metrics.jsonl``: the
  samples of the steps over the wall time between the first and the last step of the
  span) from step ``--warmup`` to the slowdown;
- ``throughput_slowed``: from the slowdown to the detection;
- ``throughput_after_action``: from ``--warmup`` steps after the first
  ``recovery_finished`` after the detection to the end (``None`` when nothing was
  replaced or shrunk);
- ``recovered_ratio``: ``throughput_after_action / throughput_healthy``. A step's
  samples are the same per rank, so after a shrink from 4 to 3 ranks the ratio is about
  0.75 at best (nothing grows back: the straggler's node is kept out of the role);
- ``action``: the action the ``straggler_detected`` event names (``report`` when a
  shrink fell back); ``configured_action``: ``--action``; per run, ``world_sizes``
  (the elastic role's history, ``None`` without one).

The last stdout line is one JSON object with the medians of these keys over the runs,
``spread`` (key -> ``[min, max]`` over the runs), the settings (``workload``, ``ranks``,
``window_s``, ``windows``, ``factor``, ``speed``) and ``runs``: every run's figures.
Smoke run: ``python benchmarks/straggler.py --runs 1 --steps 150 --steps-after 40
--window-s 1.5``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def throughput(steps: list[dict], t_from: float, t_to: float) -> float | None:
    """samples/s of the step records with ``t_from <= ts <= t_to``: the samples of all
    but the first over the time from the first to the last (``None``: < 3 records)."""
    span = [r for r in steps if t_from <= r["ts"] <= t_to]
    if len(span) < 3:
        return None
    dt = span[-1]["ts"] - span[0]["ts"]
    return sum(r["samples"] for r in span[1:]) / dt if dt > 0 else None


def job_spec(args: argparse.Namespace) -> Any:
    """The ``--ranks``-rank job (default 4): one node of that many ranks (``replace``,
    ``report``), or, for ``shrink``, an elastic role of one rank on each of that many
    nodes (``nodes: "MIN_NODES:RANKS"``, no standby: a shrink does not use it)."""
    from dlrover_core import load_spec

    workload = {"ddp": "DDPSteps", "sync": "SyncSteps"}[args.workload]
    trainer = {"workload": f"tests.node_health_workloads:{workload}", "total": args.ranks,
               "per_node": args.ranks, "backend": "ddp", "resources": {"cpu": 1}}
    failover = {}
    if args.action == "shrink":
        trainer.update(per_node=1, nodes=f"{args.min_nodes}:{args.ranks}")
        failover["standby"] = False
    return load_spec({
        "name": f"straggler-bench-{int(time.time() * 1000) % 10**8}",
        "roles": {"trainer": trainer}, "failover": failover,
        "node_health": {"straggler_action": args.action, "straggler_window_s": args.window_s,
                        "straggler_windows": args.windows,
                        "straggler_factor": args.factor},
        "config": {"steps": args.steps, "steps_after_restart": args.steps_after,
                   "size": 128, "work": args.work,
                   "batch": args.batch if args.workload == "ddp" else 8}})


def one_run(args: argparse.Namespace, job_dir: str) -> dict:
    import ray

    from dlrover_core.master.client import create_master
    from dlrover_core.master.events import read_events
    from tests.node_health_workloads import DutyCycle

    master = create_master(job_spec(args), job_dir)
    ray.get(master.start.remote())
    seen: dict = {}
    cycle = DutyCycle(lambda: [seen["pid"]] if "pid" in seen else [], speed=args.speed,
                      period_s=args.period_s)
    summary = None
    try:
        while summary is None:
            st = ray.get(master.status.remote(), timeout=30)
            victim = st["instances"].get(f"trainer-{args.rank}", {})
            if "pid" not in seen and st["step"] >= args.slow_at and \
                    victim.get("state") == "running":
                seen["pid"], seen["at"] = victim["pid"], time.time()
                cycle.start()
            elif "pid" in seen and victim.get("pid") != seen["pid"] and cycle.is_alive():
                cycle.stop()
            summary = st["summary"]
            time.sleep(0.05)
    finally:
        if cycle.is_alive():
            cycle.stop()
        ray.kill(master)
    events = read_events(os.path.join(job_dir, "events.jsonl"))
    steps = [r for r in read_events(os.path.join(job_dir, "metrics.jsonl"))
             if r["event"] == "step"]
    slowed_at = seen.get("at")
    # the first detection after the slowdown began (one before it is a false alarm, not
    # this figure), and the first recovery after that detection
    detected = next((e for e in events if e["event"] == "straggler_detected"
                     and slowed_at is not None and e["ts"] >= slowed_at), None)
    recovered = next((e for e in events if e["event"] == "recovery_finished"
                      and detected is not None and e["ts"] >= detected["ts"]), None)
    healthy_from = next((r["ts"] for r in steps if r["step"] >= args.warmup), None)
    healthy = throughput(steps, healthy_from, slowed_at) if healthy_from and slowed_at \
        else None
    slowed = throughput(steps, slowed_at, detected["ts"]) if detected else None
    after = None
    if recovered is not None:
        later = [r for r in steps if r["ts"] > recovered["ts"]]
        if len(later) > args.warmup:
            after = throughput(steps, later[args.warmup]["ts"], float("inf"))
    return {"detected_after_s": round(detected["ts"] - slowed_at, 3) if detected else None,
            "throughput_healthy": healthy, "throughput_slowed": slowed,
            "throughput_after_action": after,
            "recovered_ratio": after / healthy if after and healthy else None,
            "action": detected["action"] if detected else None,
            "world_sizes": [w["world_size"] for w in summary.get("world_sizes", [])] or None,
            "status": summary["status"]}


def median(runs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in runs if r[key] is not None]
    return round(statistics.median(xs), 4) if xs else None


def spread(runs: list[dict], key: str) -> list[float] | None:
    """``[min, max]`` of ``key`` over the runs that have it."""
    xs = [r[key] for r in runs if r[key] is not None]
    return [round(min(xs), 4), round(max(xs), 4)] if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workload", default="ddp", choices=("ddp", "sync"),
                   help="ddp: a DDP loop that times nothing (DDPSteps); sync: SyncSteps")
    p.add_argument("--batch", type=int, default=2048,
                   help="ddp: rows of the batch (about 40 ms of compute per step here)")
    p.add_argument("--ranks", type=int, default=2,
                   help="ranks of the job; on a machine with fewer cores than ranks + 1 a "
                        "duty-cycled rank frees a core for the others and barely slows "
                        "the step (2 cores: use --ranks 2)")
    p.add_argument("--steps", type=int, default=600, help="steps of a run (attempt 0)")
    p.add_argument("--steps-after", type=int, default=300,
                   help="steps after the straggler was replaced")
    p.add_argument("--work", type=int, default=300, help="sync: matmuls per step")
    p.add_argument("--slow-at", type=int, default=50)
    p.add_argument("--rank", type=int, default=1, help="the rank that is slowed")
    p.add_argument("--speed", type=float, default=0.4)
    p.add_argument("--period-s", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--action", default="replace", choices=("replace", "shrink", "report"),
                   help="node_health.straggler_action; shrink runs on a 4-node "
                        "cluster_utils cluster, one rank per node")
    p.add_argument("--min-nodes", type=int, default=2,
                   help="shrink: the elastic role's MIN nodes, below --ranks (its MAX)")
    p.add_argument("--window-s", type=float, default=5.0)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--factor", type=float, default=2.0)
    args = p.parse_args()

    from dlrover_core.master.client import init_ray
    from dlrover_core.testing import multinode_cluster

    os.chdir(ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])
    root = tempfile.mkdtemp(prefix="straggler-bench-")
    runs = []
    with contextlib.ExitStack() as stack:
        if args.action == "shrink":  # a node per rank: shrink drops the straggler's node
            stack.enter_context(multinode_cluster(workers=args.ranks, cpus=1))
        else:
            temp_dir = tempfile.mkdtemp(prefix="dlsb", dir="/tmp")
            # the ranks and the warm standby
            init_ray(None, num_cpus=args.ranks + 1, _temp_dir=temp_dir)
        for i in range(args.runs):
            runs.append(one_run(args, os.path.join(root, f"run{i}")))
            print(json.dumps(runs[-1]), file=sys.stderr)
    actions = {r["action"] for r in runs}
    keys = ("detected_after_s", "throughput_healthy", "throughput_slowed",
            "throughput_after_action", "recovered_ratio")
    out: dict[str, Any] = {k: median(runs, k) for k in keys}
    out["spread"] = {k: spread(runs, k) for k in keys}
    out["action"] = actions.pop() if len(actions) == 1 else sorted(map(str, actions))
    out["configured_action"] = args.action
    out["ranks"] = args.ranks
    out.update(workload=args.workload, window_s=args.window_s, windows=args.windows,
               factor=args.factor, speed=args.speed)
    out["runs"] = runs
    print(json.dumps(out))


if __name__ == "__main__":
    main()
