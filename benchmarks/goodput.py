"""Goodput under repeated faults: the nanogpt job (2 FSDP2 workers) runs for
``--minutes``, and every ``--every-s`` seconds trainer rank 1's process is SIGKILLed.

    .venv/bin/python benchmarks/goodput.py                      # 10 minutes, a kill every 60 s
    .venv/bin/python benchmarks/goodput.py --minutes 3 --every-s 45 --saver disk --ckpt-every 10

Goodput (DLRover's definition) = productive training time / wall time, where productive
time = unique steps completed x the median step time (the master's ``summary.json``):
recovery, steps redone from the last checkpoint and start-up count against it. The last
line of output is one JSON object with ``goodput`` (0..1), ``faults``, ``wall_s``, and the
recovery times and steps redone behind it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from recovery import analyse, run_job, start_ray  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from dlrover_core.plugins.manager import get_plugin_manager

    default_saver = "flash" if "flash" in get_plugin_manager().savers() else "disk"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every-s", type=float, default=60.0)
    ap.add_argument("--saver", default=default_saver)
    ap.add_argument("--ckpt-every", type=int, default=None,
                    help="steps between checkpoints (default: 1 for flash, 10 for disk)")
    args = ap.parse_args(argv)
    ckpt_every = args.ckpt_every or (1 if args.saver == "flash" else 10)
    import ray

    temp = start_ray()
    job_dir = tempfile.mkdtemp(prefix="goodput-")
    wall_target = args.minutes * 60
    kills = [{"at_s": t} for t in
             [args.every_s * i for i in range(1, int(wall_target // args.every_s) + 1)]
             if t < wall_target - 5]
    over = ["name=bench-goodput", "config.max_steps=1000000", "config.eval_every=1000000",
            f"checkpoint.saver={args.saver}", f"checkpoint.every_steps={ckpt_every}",
            "checkpoint.keep=2", "failover.max_restarts=1000", "failover.max_node_failures=1000"]
    out = run_job(over, job_dir, kills, timeout_s=wall_target)
    a = analyse(job_dir, out["kill_ts"])
    s = out["summary"] or {}
    result = {
        "goodput": s.get("goodput"), "faults": len(out["kill_ts"]), "wall_s": s.get("wall_s"),
        "steps": s.get("steps"), "restarts": (s.get("restarts") or {}).get("total"),
        "status": s.get("status"), "steps_redone": a["steps_redone"],
        "recovery_s_median": round(statistics.median(a["recovery_s"]), 3)
        if a["recovery_s"] else None,
        "master_recovery_s": a["master_recovery_s"], "saver": args.saver,
        "ckpt_every": ckpt_every, "minutes": args.minutes, "every_s": args.every_s,
    }
    shutil.rmtree(job_dir, ignore_errors=True)
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
