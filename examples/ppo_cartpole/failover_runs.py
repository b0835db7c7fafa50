"""The CartPole example with one process SIGKILLed from outside mid-run (the figures of
docs/ppo.md, "Failover").

    python -m examples.ppo_cartpole.failover_runs [--repeats 3] [--kill-after 15]

For each of: no kill, a rollout rank, the driver, the actor rank, it runs
``examples/ppo_cartpole/job.yaml`` as it is (stops at a mean return of 475), SIGKILLs
that process (its pid as the master reports it) once the driver reported iteration
``--kill-after``, and prints one JSON line per run: status, restarts, whether the driver
restarted, the recovery's seconds (``recovery_finished``), ``mean_return`` at the
reported iteration before the kill and at the next one, the final ``mean_return``,
``iterations``, ``total_env_steps`` and ``iterations x 2048``. The last line is a JSON
summary per kind: medians and (min, max) of the recovery seconds and ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time

STEPS_PER_ITERATION = 2 * 8 * 128


def one_run(kill: str | None, kill_after: int, base: str) -> dict:
    import ray

    from dlrover_core import load_spec
    from dlrover_core.master.client import create_master

    job_dir = tempfile.mkdtemp(prefix=f"{kill or 'none'}-", dir=base)
    spec = load_spec("examples/ppo_cartpole/job.yaml",
                     [f"name=ppo-cartpole-{kill or 'none'}-{os.path.basename(job_dir)[-6:]}"])
    master = create_master(spec, job_dir)
    t0 = time.time()
    ray.get(master.start.remote())
    if kill is not None:
        while (st := ray.get(master.status.remote()))["step"] < kill_after:
            if st["state"] in ("succeeded", "failed", "stopped"):
                break
            time.sleep(0.01)
        os.kill(st["instances"][kill]["pid"], signal.SIGKILL)
    summary = ray.get(master.wait.remote(900))
    wall = time.time() - t0
    ray.kill(master)
    with open(os.path.join(job_dir, "events.jsonl")) as f:
        events = [json.loads(line) for line in f]
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("role") == "driver" and "fit_s" not in r]
    by_step = {}
    for r in rows:  # the newest report of each step
        by_step[r["step"]] = r
    m = summary["metrics"]
    rec = [e for e in events if e["event"] == "recovery_finished"]
    started = [e for e in events if e["event"] == "recovery_started"]
    its = int(m.get("iterations", 0))
    return {
        "kill": kill, "status": summary["status"], "restarts": summary["restarts"]["total"],
        "driver_restarted": any(e["event"] == "instance_started" and e["role"] == "driver"
                                and e["attempt"] > 0 for e in events),
        "scope": started[0].get("scope") if started else None,
        "recovery_s": rec[0]["seconds"] if rec else None,
        "mean_return_before": by_step.get(kill_after, {}).get("mean_return"),
        "mean_return_next": by_step.get(kill_after + 1, {}).get("mean_return"),
        "mean_return_final": m.get("mean_return"), "iterations": its,
        "reports": len(rows), "total_env_steps": m.get("total_env_steps"),
        "iterations_x_2048": its * STEPS_PER_ITERATION,
        "greedy_return_after": m.get("greedy_return_after"),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kill-after", type=int, default=15)
    ap.add_argument("--kinds", default="none,rollout-1,driver,actor-0")
    args = ap.parse_args()
    from dlrover_core.testing import start_test_ray

    start_test_ray()
    base = tempfile.mkdtemp(prefix="ppo-failover-")
    out: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for kind in args.kinds.split(","):
            r = one_run(None if kind == "none" else kind, args.kill_after, base)
            out.setdefault(kind, []).append(r)
            print(json.dumps(r), flush=True)

    def spread(xs: list) -> dict:
        xs = [x for x in xs if x is not None]
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}

    print(json.dumps({kind: {"recovery_s": spread([r["recovery_s"] for r in runs]),
                             "wall_s": spread([r["wall_s"] for r in runs]),
                             "exact_env_steps": all(r["total_env_steps"] == r["iterations_x_2048"]
                                                    for r in runs)}
                      for kind, runs in out.items()}), flush=True)


if __name__ == "__main__":
    main()
