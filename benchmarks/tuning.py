"""Online tuning against the default config and a static grid, in one run.

    .venv/bin/python benchmarks/tuning.py [--steps-per-point 24] [--tuned-steps 240]

The job: the tuned nanoGPT example (``examples/nanogpt/tuned_workload.py``; by default
made smaller with ``--model``: 2 layers, 64 wide, context 64, AdamW) whose training samples are read from a store with
``--latency`` seconds per sample (simulated storage latency) and decoded on the CPU,
a global batch of 32 samples per optimizer step. Its own training loop runs in this
process, one rank, ``--threads`` torch threads, through the same pieces a job uses:
``ElasticDataLoader``, ``TuningSession`` and the master's ``TuningController`` with
the built-in tuners (``dataloader_workers``, ``micro_batch``) and the guard, fed the
step reports the workload makes.

Runs, one after another in this process:

1. ``default``: the job's starting config (``num_workers=0``, micro-batch 4 x 8
   accumulation steps) for ``--steps-per-point`` steps;
2. ``grid``: every point of num_workers {0, 1, 2, 4} x micro-batch {4, 8, 16, 32}
   (accumulation keeps 32 samples per step), each a fresh run of
   ``--steps-per-point`` steps (what a restart-per-trial autotuner has to do);
3. ``tuned``: one run of ``--tuned-steps`` steps from the default config, tuned while it
   trains (``tuning.interval_steps`` from ``--interval``).

Throughput of a run: the median of the per-step samples/s after the first
``--warmup`` steps (loader start-up, and the prefetch queue that fills meanwhile:
up to two batches per worker, i.e. several steps at large micro-batches); of the tuned
run: the median over its last ``--steps-per-point - --warmup`` steps. The grid's best point is measured a second time and ``grid_best_samples_s`` is the
mean of both (the largest of 16 noisy figures is biased upwards).
``steps_to_reach_95pct``: the first step of the tuned run
from which the median of 5 consecutive steps reaches 95 % of the grid's best.
``restarts``: times the training process was restarted to change the config (the
tuned run changes it in place: 0 by construction here; a job's restarts are in its
summary). ``versions``: config versions published (0 = never changed).

Shared machines distort throughput; compare the ratios of one run. The last line of
output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from dlrover_core.runtime.backend import BackendSession  # noqa: E402
from dlrover_core.runtime.context import WorkerContext  # noqa: E402
from dlrover_core.tuning.session import ControllerSource, TuningSession  # noqa: E402
from examples.nanogpt.tuned_workload import TunedGPTWorkload  # noqa: E402

GLOBAL = 32
JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "examples", "nanogpt", "job_tuned.yaml")


class BenchWorkload(TunedGPTWorkload):
    """The example's workload in this process: reports go to a list (and to the
    controller of the tuned run) instead of a JobMaster."""

    controller = None

    def _master_or_none(self):
        return None

    def make_tuning_session(self, initial: dict) -> TuningSession:
        source = ControllerSource(self.controller, "trainer") if self.controller else None
        return TuningSession(initial, source=source)

    def report(self, step: int, **metrics: float) -> None:
        super().report(step, **metrics)
        if "samples_per_s" in metrics:
            self.steps.append(dict(metrics))
        if self.controller is not None:
            self.controller.on_report("trainer", 0, step, metrics)


def run(config: dict, steps: int, job_dir: str, controller=None) -> list[dict]:
    ctx = WorkerContext(job="bench", role="trainer", rank=0, world_size=1, local_rank=0,
                        local_world_size=1, config={**config, "max_steps": steps,
                                                    "eval_every": steps + 1},
                        checkpoint={"saver": "disk", "every_steps": 0,
                                    "dir": os.path.join(job_dir, f"ckpt{time.time_ns()}")},
                        job_dir=job_dir)
    w = BenchWorkload(ctx)
    w.controller = controller
    w.steps = []
    w._backend = BackendSession(ctx)
    w._plugins = _plugins()  # what a WorkloadHost gives its workload
    w.setup()
    try:
        w.run()
    finally:
        w.teardown()
    return w.steps


_PM = None


def _plugins():
    global _PM
    if _PM is None:
        from dlrover_core.plugins.manager import PluginManager

        _PM = PluginManager()
    return _PM


def throughput(steps: list[dict], skip: int) -> float:
    return statistics.median(s["samples_per_s"] for s in steps[skip:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps-per-point", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--tuned-steps", type=int, default=240)
    ap.add_argument("--interval", type=int, default=10)
    ap.add_argument("--latency", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="n_layer=2,n_embd=64,n_head=2,block_size=64",
                    help="model config overrides (the example's own: 4 layers, 128 wide)")
    ap.add_argument("--workers", default="0,1,2,4")
    ap.add_argument("--micro-batches", default="4,8,16,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from omegaconf import OmegaConf

    from dlrover_core.spec.loader import load_spec
    from dlrover_core.tuning.controller import TuningController

    spec = load_spec(JOB, plugin_manager=_plugins(), overrides=["tuning.enabled=true", "roles.trainer.total=1",
                           "roles.trainer.per_node=1", f"tuning.interval_steps={args.interval}"])
    base = OmegaConf.to_container(spec.config, resolve=True)
    base["read_latency_s"] = args.latency
    for kv in filter(None, args.model.split(",")):
        k, _, v = kv.partition("=")
        base[k] = int(v)
    job_dir = tempfile.mkdtemp(prefix="dlrover-bench-tuning-")
    n = args.steps_per_point
    t0 = time.time()

    default = throughput(run(base, n, job_dir), args.warmup)
    print(f"default: {default:.1f} samples/s", file=sys.stderr)
    grid = {}
    for nw in (int(x) for x in args.workers.split(",")):
        for mb in (int(x) for x in args.micro_batches.split(",")):
            cfg = {**base, "num_workers": nw, "micro_batch": mb, "grad_accum_steps": GLOBAL // mb}
            grid[f"num_workers={nw},micro_batch={mb}"] = throughput(run(cfg, n, job_dir),
                                                                    args.warmup)
            print(f"grid {nw} x {mb}: {grid[list(grid)[-1]]:.1f}", file=sys.stderr)
    best_key = max(grid, key=grid.get)
    raw_best = grid[best_key]
    # the largest of 16 noisy figures is biased upwards: measure the winner once more
    nw, mb = (int(kv.split("=")[1]) for kv in best_key.split(","))
    again = throughput(run({**base, "num_workers": nw, "micro_batch": mb,
                            "grad_accum_steps": GLOBAL // mb}, n, job_dir), args.warmup)
    best = (raw_best + again) / 2
    print(f"grid best {best_key}: {raw_best:.1f}, again {again:.1f}", file=sys.stderr)

    events: list = []
    ctl = TuningController.from_spec(spec, _plugins(),
                                     emit=lambda e, **f: events.append({"event": e, **f}))
    tuned_steps = run(base, args.tuned_steps, job_dir, controller=ctl)
    tuned = throughput(tuned_steps[-(n - args.warmup):], 0)
    sps = [s["samples_per_s"] for s in tuned_steps]
    reach = next((i for i in range(len(sps) - 4)
                  if statistics.median(sps[i:i + 5]) >= 0.95 * best), None)
    final = ctl.summary()
    out = {
        "default_samples_s": round(default, 2), "tuned_samples_s": round(tuned, 2),
        "grid_best_samples_s": round(best, 2), "grid_best_config": best_key,
        "grid_best_first_samples_s": round(raw_best, 2), "grid_best_again_samples_s": round(again, 2),
        "tuned_vs_grid_best": round(tuned / best, 3),
        "tuned_vs_default": round(tuned / default, 3),
        "steps_to_reach_95pct": reach, "restarts": 0, "versions": final["version"],
        "tuned_final_config": {"num_workers": final["config"]["dataloader"]["num_workers"],
                               "micro_batch": final["config"]["dataloader"]["batch_size"],
                               "grad_accum_steps": final["config"]["optimizer"]["grad_accum_steps"]},
        "accepted": final["accepted"], "reverted": final["reverted"],
        "grid_points": len(grid), "steps_per_point": n, "tuned_steps": args.tuned_steps,
        "latency_s": args.latency, "threads": args.threads, "model": args.model,
        "wall_s": round(time.time() - t0, 1),
    }
    for e in events:
        if e["event"] in ("tuning_proposed", "tuning_accepted", "tuning_reverted"):
            print(e["event"], e.get("version"), e.get("changes", e.get("reason", "")),
                  file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
