"""Online tuning against the shipped default and a static grid, every run a real job.

    .venv/bin/python benchmarks/tuning.py [--window-s 240] [--warmup-steps 5]
        [--grid 4x16,8x16,8x32] [--shorter-windows-s 120]

The job: ``examples/nanogpt/job_tuned.yaml`` (nanoGPT whose input pipeline reads every
sample from simulated storage), 2 FSDP2 ranks on gloo. Every run is submitted to a
JobMaster the way ``dlrover submit`` does it (``create_master`` + ``start`` on one
local Ray cluster that all runs share), one after another:

1. ``default``: the job as shipped (tuning off): its ``num_workers``, ``micro_batch``
   and ``grad_accum_steps``;
2. ``grid``: each ``--grid`` point ``<num_workers>x<micro_batch>`` (gradient
   accumulation keeps the shipped samples per rank per optimizer step), tuning off;
3. ``tuned``: the job as shipped with ``tuning.enabled=true`` (it starts from the
   default and tunes while it trains; its trials count against it);
4. ``grid_best_rerun``: the grid point that measured the most samples, run once more.
   ``rerun_vs_grid_best`` (its samples over that point's first run) is what a tuner
   that ran the best point from its first step, with no trial to pay for, would be
   measured at: the ceiling that run-to-run noise leaves ``tuned_vs_grid_best`` (the
   best of several noisy grid runs is favoured by the noise).

Every run is measured the same way: its first ``--warmup-steps`` steps are the warm-up
(start-up, loader workers, the first allocations); the timed window is the
``--window-s`` seconds that follow the end of the last warm-up step, on the master's
clock (the ``ts`` of rank 0's step records in ``metrics.jsonl``, written when each
report arrives). ``samples`` is the global samples (``samples`` of each step report)
of the steps that ended inside the window (a step re-run after a restart is not counted
twice); ``seconds`` is ``--window-s`` for every run. Throughput is ``samples /
seconds``: samples over wall time, data waits included (``method``:
``samples_over_wall``). The job is stopped once its window is over; evaluation is off
(``config.eval_every`` beyond the run) so that every run measures training alone.

A tuned run pays for its trials once, so its figure depends on the window's length: the
same runs are also measured over each ``--shorter-windows-s`` window (a prefix of the
timed window: the same start, fewer seconds), reported under ``shorter_windows`` with
their own ratios (there ``rerun_vs_grid_best`` is the re-run of the complete window's
best point over that point's first run, both over the shorter window: the best point
of a shorter window can be another one).

Every run is reported; none is selected or replaced (item 4's re-run is reported
beside the first run of its point, not instead of it). ``tuned_vs_grid_best`` is the
tuned run's samples over the most samples of a grid point (first runs);
``tuned_vs_default`` over the default's. ``restarts`` is the tuned job's
``restarts.total`` read from its ``summary.json``, ``versions`` the tuning version it
ended on and ``final_config`` that version's settings. The last line of stdout is one
JSON object; progress goes to stderr. Timings are only comparable on an otherwise idle
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

JOB = os.path.join(ROOT, "examples", "nanogpt", "job_tuned.yaml")
FAR = 10**9  # steps: the job never ends by itself; it is stopped after its window


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def step_records(job_dir: str) -> list[dict]:
    from dlrover_core.master.events import read_events

    path = os.path.join(job_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [r for r in read_events(path) if r.get("event") == "step" and "samples" in r]


def window(records: list[dict], warmup_steps: int, seconds: float) -> tuple[float, bool]:
    """``(samples, complete)``: the samples of the steps that ended within ``seconds``
    after the end of step ``warmup_steps - 1``, and whether the window is over."""
    t0 = next((r["ts"] for r in records if r["step"] == warmup_steps - 1), None)
    if t0 is None:
        return 0.0, False
    samples, done, seen = 0.0, -1, False
    for r in records:
        if r["ts"] > t0 + seconds:
            seen = True
            continue
        if r["ts"] > t0 and r["step"] > done:  # a step re-run after a restart: once
            samples += float(r["samples"])
        done = max(done, r["step"])
    return samples, seen


def run_job(name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    """Submit one job, stop it after its timed window; its figures and summary
    (``shorter``: the samples of each of ``args.shorter_windows_s``, if given)."""
    import ray

    from dlrover_core import load_spec
    from dlrover_core.master.client import create_master

    spec = load_spec(JOB, [f"name={name}", f"config.max_steps={FAR}",
                           f"config.eval_every={FAR}", *overrides])
    job_dir = tempfile.mkdtemp(prefix=f"dlrover-bench-{name}-")
    master = create_master(spec, job_dir)
    ray.get(master.start.remote())
    started = time.time()
    samples, complete, summary, records = 0.0, False, None, []
    while time.time() - started < args.timeout_s:
        time.sleep(0.5)
        records = step_records(job_dir)
        samples, complete = window(records, args.warmup_steps, args.window_s)
        status = ray.get(master.status.remote(), timeout=60)
        if complete or status["summary"] is not None:
            summary = status["summary"]
            break
    if summary is None:
        master.stop.remote()
        summary = ray.get(master.wait.remote(120), timeout=180)
    ray.kill(master, no_restart=True)
    with open(os.path.join(job_dir, "summary.json")) as f:
        on_disk = json.load(f)
    if not complete:
        raise RuntimeError(f"run {name}: the job ended ({(summary or {}).get('status')}: "
                           f"{(summary or {}).get('error')}) or timed out before its "
                           f"{args.window_s} s window was over; see {job_dir}")
    log(f"{name}: {samples:.0f} samples in {args.window_s} s "
        f"({samples / args.window_s:.1f} samples/s), job dir {job_dir}")
    # every shorter window is a prefix of the complete one: the records read then hold it
    shorter = {s: int(window(records, args.warmup_steps, s)[0])
               for s in getattr(args, "shorter_windows_s", [])}
    return {"samples": int(samples), "seconds": args.window_s, "summary": on_disk,
            "shorter": shorter}


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window-s", type=float, default=240.0,
                    help="timed window of every run, seconds")
    ap.add_argument("--shorter-windows-s", default="120",
                    help="comma-separated windows (s, each under --window-s) over which "
                         "the same runs are also measured, from the same start")
    ap.add_argument("--warmup-steps", type=int, default=5,
                    help="steps of every run before its window starts")
    ap.add_argument("--grid", default="4x16,8x16,8x32",
                    help="grid points <num_workers>x<micro_batch>, comma-separated")
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="give up on a run after this long")
    ap.add_argument("--set", action="append", default=[],
                    help="an extra key=value override for every run (e.g. a smaller model)")
    args = ap.parse_args()
    args.shorter_windows_s = [float(x) for x in filter(None, args.shorter_windows_s.split(","))]
    for s in args.shorter_windows_s:
        if not 0 < s < args.window_s:
            raise SystemExit(f"--shorter-windows-s: {s} is invalid; allowed: seconds in "
                             f"(0, --window-s = {args.window_s})")
    os.chdir(ROOT)  # the workers import examples.* from here

    import ray
    from omegaconf import OmegaConf

    from dlrover_core import load_spec
    from dlrover_core.master.client import init_ray

    shipped = load_spec(JOB)
    cfg = OmegaConf.to_container(shipped.config, resolve=True)
    per_rank = int(cfg["micro_batch"]) * int(cfg["grad_accum_steps"])
    points = []
    for p in filter(None, args.grid.split(",")):
        nw, mb = (int(x) for x in p.split("x"))
        if per_rank % mb:
            raise SystemExit(f"--grid {p}: micro_batch {mb} does not divide the {per_rank} "
                             "samples per rank per step the job ships")
        points.append({"num_workers": nw, "micro_batch": mb, "grad_accum_steps": per_rank // mb})

    t_start = time.time()
    started_here = init_ray(None)
    try:
        stamp = time.strftime("%H%M%S")
        default = run_job(f"bench-default-{stamp}", list(args.set), args)
        grid = []
        for i, p in enumerate(points):
            r = run_job(f"bench-grid{i}-{stamp}",
                        [*args.set, *(f"config.{k}={v}" for k, v in p.items())], args)
            grid.append({"config": p, "samples": r["samples"], "seconds": r["seconds"],
                         "shorter": r["shorter"]})
        tuned = run_job(f"bench-tuned-{stamp}", [*args.set, "tuning.enabled=true"], args)
        rerun = None
        if grid:
            top = max(grid, key=lambda g: g["samples"])
            rerun = run_job(f"bench-rerun-{stamp}", [
                *args.set, *(f"config.{k}={v}" for k, v in top["config"].items())], args)
            rerun["config"] = top["config"]
    finally:
        if started_here:
            ray.shutdown()
    t = tuned["summary"].get("tuning") or {}
    final = t.get("config") or {}
    best = max((g["samples"] for g in grid), default=0)
    shorter = []
    for s in args.shorter_windows_s:
        best_s = max((g["shorter"][s] for g in grid), default=0)
        shorter.append({"seconds": s, "default": default["shorter"][s],
                        "grid": [g["shorter"][s] for g in grid],
                        "tuned": tuned["shorter"][s],
                        "tuned_vs_grid_best": ratio(tuned["shorter"][s], best_s),
                        "tuned_vs_default": ratio(tuned["shorter"][s], default["shorter"][s]),
                        # the re-run of the complete window's best point over the same
                        # point's first run, both over this window
                        "rerun_vs_grid_best": ratio(rerun["shorter"][s], top["shorter"][s])
                        if rerun else None})
    for g in grid:
        del g["shorter"]
    out = {
        "method": "samples_over_wall",
        "default": {"samples": default["samples"], "seconds": default["seconds"]},
        "grid": grid,
        "tuned": {"samples": tuned["samples"], "seconds": tuned["seconds"],
                  "restarts": int(tuned["summary"]["restarts"]["total"]),
                  "versions": t.get("version"),
                  "final_config": {
                      "num_workers": final.get("dataloader", {}).get("num_workers"),
                      "micro_batch": final.get("dataloader", {}).get("batch_size"),
                      "grad_accum_steps": final.get("optimizer", {}).get("grad_accum_steps"),
                      "learning_rate": final.get("optimizer", {}).get("learning_rate")}},
        "tuned_vs_grid_best": ratio(tuned["samples"], best),
        "tuned_vs_default": ratio(tuned["samples"], default["samples"]),
        "grid_best_rerun": None if rerun is None else {
            "config": rerun["config"], "samples": rerun["samples"], "seconds": rerun["seconds"]},
        "rerun_vs_grid_best": ratio(rerun["samples"], best) if rerun else None,
        "shorter_windows": shorter,
    }
    log(f"wall time of the benchmark: {time.time() - t_start:.1f} s; tuning of the tuned "
        f"run: {t.get('proposed')} proposed, {t.get('accepted')} kept, "
        f"{t.get('reverted')} reverted")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
