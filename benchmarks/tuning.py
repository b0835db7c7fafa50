"""Online tuning against the shipped default and a static grid, every run a real job.

    .venv/bin/python benchmarks/tuning.py [--window-s 240] [--warmup-steps 5]
        [--grid 4x16,8x16,8x32] [--shorter-windows-s 120]
    .venv/bin/python benchmarks/tuning.py --sliced [--workload known_optimum]
        [--window-s 240] [--slice-s 20]

``--sliced``: the tuned job and a fresh job at the peer settings (``known_optimum``:
``examples/known_optimum``, whose costs are sleeps, at its optimum by the cost model;
``nanogpt``: at ``--best``, the best grid point of an earlier run) are submitted
together and run in alternating slices of ``--slice-s`` seconds: one runs while the
other stands still before a step (``config.pause_file``, :mod:`examples.slices`; the
paused time is out of its step timer's intervals and so out of the tuner's windows),
until each ran ``--window-s`` seconds, so that a drift of the machine's speed hits
both alike. A slice's rate is the samples of the steps it ran over its seconds (from
the resume to the moment every rank stood still). Printed: ``sliced_ratio``: the
geometric mean of the tuned job's rate over the peer's in adjacent slices (each pair
of neighbours in time: a linear drift cancels) from the first slice the tuned job ran
wholly under its final tuning version (steady state), with the 90 % t-interval
(``lower90``, ``upper90``; adjacent pairs share a slice, so half the pairs count as
degrees of freedom); ``tuning_cost``: the same geometric mean over the slices before;
``vs_optimum`` (``vs_peer`` for nanogpt): the tuned job's samples over its first
``--window-s`` active seconds, trials included, over the peer's; ``restarts``,
``final_version``, ``final_config``, every slice (``slices``), and the cost model's
optimum (``known_optimum``).

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


# ---------------------------------------------------------------------------- --sliced
KNOWN = os.path.join(ROOT, "examples", "known_optimum", "job.yaml")
#: two-sided 90 % t quantiles by degrees of freedom (1..30); beyond: 1.645
T90 = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782,
       1.771, 1.761, 1.753, 1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711,
       1.708, 1.706, 1.703, 1.701, 1.699, 1.697]


def start_paused(name: str, job: str, overrides: list[str], pause_file: str):
    """A job submitted with ``config.pause_file`` already present: its ranks set up and
    stop before their first step. Returns ``(master, job_dir)``."""
    import ray

    from dlrover_core import load_spec
    from dlrover_core.master.client import create_master

    open(pause_file, "w").close()
    spec = load_spec(job, [f"name={name}", f"+config.pause_file={pause_file}", *overrides])
    job_dir = tempfile.mkdtemp(prefix=f"dlrover-bench-{name}-")
    master = create_master(spec, job_dir)
    ray.get(master.start.remote())
    return master, job_dir


def slice_samples(job_dir: str, first: int, stop: int
                  ) -> tuple[float, int | None, int | None]:
    """Global samples of steps ``[first, stop)`` (rank 0's step records; a step reported
    twice, after a restart, once) and the ``tuning_version`` of the first and of the
    last of them."""
    seen: dict[int, dict] = {}
    for r in step_records(job_dir):
        if first <= r["step"] < stop:
            seen[r["step"]] = r

    def version(step: int) -> int | None:
        v = seen[step].get("tuning_version")
        return None if v is None else int(v)

    return (sum(float(r["samples"]) for r in seen.values()),
            version(min(seen)) if seen else None, version(max(seen)) if seen else None)


def steady_start(tuned: list[dict]) -> int:
    """Index of the first of the tuned job's slices (``{"version", "first_version"}``:
    the tuning version of a slice's last and first step) from which every slice ran
    wholly under the final version; ``len(tuned)`` when none did."""
    final = tuned[-1]["version"] if tuned else None
    return next((i for i in range(len(tuned)) if all(
        s["version"] == final and s.get("first_version") == final for s in tuned[i:])),
        len(tuned))


def sliced_ratio(tuned: list[dict], other: list[dict], steady_from: int) -> tuple[dict, dict]:
    """``(sliced_ratio, tuning_cost)`` of the slices (``{"samples", "seconds"}`` each, the
    two jobs alternating, the tuned job first): the geometric mean of the tuned job's
    rate over the peer's in adjacent slices from slice ``steady_from`` on, with its 90 %
    t-interval (adjacent pairs share a slice: half the pairs count as degrees of
    freedom), and the same mean before it."""
    import math

    seq = []   # the slices in time order: (job, rate, index)
    for i in range(len(tuned)):
        seq.append(("tuned", tuned[i]["samples"] / tuned[i]["seconds"], i))
        if i < len(other):
            seq.append(("peer", other[i]["samples"] / other[i]["seconds"], i))

    def adjacent_logs(lo: int, hi: int) -> list[float]:
        out = []
        for a, b in zip(seq, seq[1:]):
            t, p = (a, b) if a[0] == "tuned" else (b, a)
            if lo <= t[2] < hi and p[1] > 0 and t[1] > 0:
                out.append(math.log(t[1] / p[1]))
        return out

    steady = adjacent_logs(steady_from, len(tuned))
    transient = adjacent_logs(0, steady_from)
    lo90, hi90 = interval90(steady, max(1, len(steady) // 2)) if steady else (None, None)
    return ({"geomean": round(math.exp(sum(steady) / len(steady)), 4) if steady else None,
             "lower90": round(lo90, 4) if lo90 else None,
             "upper90": round(hi90, 4) if hi90 else None,
             "pairs": len(steady), "from_slice": steady_from},
            {"geomean_before_steady": round(math.exp(sum(transient) / len(transient)), 4)
             if transient else None, "slices": steady_from})


def interval90(logs: list[float], n_eff: int) -> tuple[float, float]:
    """The 90 % t-interval of the mean of ``logs`` (log ratios) with ``n_eff`` degrees
    of freedom + 1, as ratios."""
    import math
    import statistics

    m = statistics.fmean(logs)
    if len(logs) < 2 or n_eff < 2:
        return math.exp(m), math.exp(m)
    se = statistics.stdev(logs) / math.sqrt(n_eff)
    t = T90[n_eff - 2] if n_eff - 2 < len(T90) else 1.645
    return math.exp(m - t * se), math.exp(m + t * se)


def run_sliced(args: argparse.Namespace) -> dict:
    """The tuned job and a fresh job at ``peer`` settings, both submitted at once and run
    in alternating slices of ``--slice-s`` (one runs while the other stands still at a
    step boundary: :mod:`examples.slices`), until each ran ``--window-s`` seconds. See
    the module docstring (``--sliced``)."""
    from omegaconf import OmegaConf

    from examples.slices import PauseControl

    job = KNOWN if args.workload == "known_optimum" else JOB
    cfg = OmegaConf.load(job)
    opts = OmegaConf.to_container(cfg.tuning.options, resolve=True)
    max_w = int(opts.get("dataloader_workers", {}).get("max_num_workers", 8))
    max_mb = int(opts.get("micro_batch", {}).get("max_micro_batch", 32))
    per_rank = int(cfg.config.micro_batch) * int(cfg.config.grad_accum_steps)
    known = None
    if args.workload == "known_optimum":
        from examples.known_optimum.workload import optimum

        known = optimum(OmegaConf.to_container(cfg.config, resolve=True), max_w, max_mb)
        peer = {k: known[k] for k in ("num_workers", "micro_batch", "grad_accum_steps")}
    else:
        if not args.best:
            raise SystemExit("--sliced --workload nanogpt needs --best <num_workers>x"
                             "<micro_batch> (the best grid point of an earlier run)")
        nw, mb = (int(x) for x in args.best.split("x"))
        peer = {"num_workers": nw, "micro_batch": mb, "grad_accum_steps": per_rank // mb}
    ranks = int(cfg.roles.trainer.total)
    stamp = time.strftime("%H%M%S")
    work = tempfile.mkdtemp(prefix="dlrover-bench-sliced-")
    far = [f"config.max_steps={FAR}"] + ([f"config.eval_every={FAR}"]
                                         if args.workload == "nanogpt" else [])
    jobs = {}
    for key, over in (("tuned", ["tuning.enabled=true"]),
                      ("peer", [f"config.{k}={v}" for k, v in peer.items()])):
        pf = os.path.join(work, f"pause-{key}")
        master, job_dir = start_paused(f"bench-sliced-{key}-{stamp}", job,
                                       [*args.set, *far, *over], pf)
        jobs[key] = {"master": master, "dir": job_dir, "ctl": PauseControl(pf, ranks),
                     "active_s": 0.0, "step": 0, "slices": []}
    try:
        for j in jobs.values():   # both set up and standing before their first step
            # (submitted paused: pause() would wait for these notes to go first)
            j["step"] = j["ctl"].wait_paused(timeout_s=args.timeout_s)["step"]
        order = ["tuned", "peer"]
        while min(j["active_s"] for j in jobs.values()) < args.window_s:
            for key in order:
                j = jobs[key]
                t0 = j["ctl"].resume()
                time.sleep(args.slice_s)
                stop = j["ctl"].pause(timeout_s=args.timeout_s)
                secs = stop["ts"] - t0
                samples, first_v, version = slice_samples(j["dir"], j["step"], stop["step"])
                j["slices"].append({"t0": round(t0, 3), "seconds": round(secs, 3),
                                    "steps": [j["step"], stop["step"]], "samples": samples,
                                    "version": version, "first_version": first_v})
                j["active_s"] += secs
                j["step"] = stop["step"]
            log(f"slices: tuned {jobs['tuned']['active_s']:.0f} s, peer "
                f"{jobs['peer']['active_s']:.0f} s of {args.window_s}")
    finally:
        import ray

        for j in jobs.values():
            j["ctl"].resume()
            j["master"].stop.remote()
        summaries = {}
        for key, j in jobs.items():
            try:
                summaries[key] = ray.get(j["master"].wait.remote(120), timeout=180)
            except Exception as exc:  # noqa: BLE001 - reported, the other job still ends
                summaries[key] = {"error": str(exc)}
            ray.kill(j["master"], no_restart=True)

    def first_window(slices: list[dict]) -> float:
        """Samples over the first ``--window-s`` active seconds (the last slice cut
        in proportion)."""
        left, samples = args.window_s, 0.0
        for sl in slices:
            take = min(1.0, left / sl["seconds"]) if sl["seconds"] else 0.0
            samples += sl["samples"] * take
            left -= sl["seconds"] * take
            if left <= 1e-9:
                break
        return samples

    tuned, other = jobs["tuned"]["slices"], jobs["peer"]["slices"]
    final_version = tuned[-1]["version"]
    steady_from = steady_start(tuned)   # the steady state: from there on
    sliced, cost = sliced_ratio(tuned, other, steady_from)
    tuned_w, peer_w = first_window(tuned), first_window(other)
    t_sum = summaries.get("tuned") or {}
    out = {
        "method": "alternating_slices",
        "workload": args.workload, "slice_s": args.slice_s, "window_s": args.window_s,
        "peer_config": peer,
        "sliced_ratio": sliced, "tuning_cost": cost,
        "vs_optimum" if known else "vs_peer": ratio(tuned_w, peer_w),
        "tuned_samples_in_window": round(tuned_w), "peer_samples_in_window": round(peer_w),
        "restarts": int(((t_sum.get("restarts") or {}).get("total")) or 0),
        "final_version": final_version,
        "final_config": ((t_sum.get("tuning") or {}).get("config")),
        "slices": {"tuned": tuned, "peer": other},
    }
    if known:
        out["known_optimum"] = {k: round(v, 2) if isinstance(v, float) else v
                                for k, v in known.items()}
    return out


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
    ap.add_argument("--sliced", action="store_true",
                    help="the tuned job beside a fresh job at the optimum (or --best) in "
                         "alternating slices (see the module docstring)")
    ap.add_argument("--workload", choices=("known_optimum", "nanogpt"),
                    default="known_optimum", help="--sliced: the job")
    ap.add_argument("--best", default=None,
                    help="--sliced --workload nanogpt: the peer's <num_workers>x<micro_batch>")
    ap.add_argument("--slice-s", type=float, default=20.0,
                    help="--sliced: seconds each job runs per slice")
    args = ap.parse_args()
    args.shorter_windows_s = [float(x) for x in filter(None, args.shorter_windows_s.split(","))]
    for s in args.shorter_windows_s:
        if not 0 < s < args.window_s:
            raise SystemExit(f"--shorter-windows-s: {s} is invalid; allowed: seconds in "
                             f"(0, --window-s = {args.window_s})")
    os.chdir(ROOT)  # the workers import examples.* from here
    if args.sliced:
        from omegaconf import OmegaConf

        from dlrover_core.master.client import init_ray

        # both jobs stand placed at once (one runs while the other is paused), so the
        # local cluster gets the CPUs of both: with the machine's own count (2 here) the
        # peer's ranks were never placed and never paused
        t = OmegaConf.load(KNOWN if args.workload == "known_optimum" else JOB).roles.trainer
        need = 2 * int(t.total) * float(t.get("resources", {}).get("cpu", 1))
        started_here = init_ray(None, num_cpus=max(os.cpu_count() or 1, int(need + 0.999)))
        try:
            out = run_sliced(args)
        finally:
            if started_here:
                import ray

                ray.shutdown()
        print(json.dumps(out))
        return

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
