"""Elastic benchmark: a 3-node ``ray.cluster_utils.Cluster``, one node removed mid-run and
one added back later; how soon training resumes after the loss, against Ray Train v2.

    .venv/bin/pip install -e ".[bench]"      # Ray Train for the baseline (optional)
    .venv/bin/python benchmarks/elastic.py --steps 80 --remove-at 20 --add-at 45 --runs 3

Ours: the elastic workload of the tests (``tests/elastic_workloads.py``: a small MLP under
``ddp``, batches from the master's shard service, the global batch kept by gradient
accumulation, the shard state in the checkpoint) as role ``trainer`` with ``nodes:
"1:3"``, one rank per worker node, checkpoints every ``--ckpt-every`` steps (``--saver``,
default ``flash``: the in-memory saver with one replica on another node, so the shrunk
role restores from memory; ``restore_sources`` says where each start restored from),
``elastic.replacement_timeout_s`` ``--replacement-timeout-s``.

Ray Train: ``TorchTrainer`` with ``ScalingConfig(num_workers=(1, 3))`` (Ray Train v2's
elastic range), the same model, data order and step time, a checkpoint every
``--ckpt-every`` steps, the same node removed. Without Ray Train (the ``bench`` extra) or
when its version refuses the range, the JSON says why (``ray_train_error``) and the
baseline figures are ``null``.

Both sides measure the same thing: ``resume_after_loss_s`` (ours) and
``ray_train_resume_after_loss_s`` are from the node removal to the first step completed
at a world size other than the one before the removal (ours: a ``step`` record of
``metrics.jsonl``; Ray Train: a line its workers log after each step). A step a survivor
completes at the old world size after the removal does not count.

``--runs N`` (default 3) runs both sides N times. The last stdout line is one JSON object:
``world_sizes`` (ours, history: ``[world_size, step]``, of each run), ``samples_lost``,
``samples_duplicated``, ``samples_reread_after_rollback``, ``resume_after_loss_s``,
``ray_train_resume_after_loss_s``, ``ratio`` (ours / Ray Train's, per run) and
``goodput``: each the median over the runs; ``spread``: per figure ``{"median", "min",
"max", "n"}`` (``n``: runs with a value); ``runs``: every run's figures, in order, none
left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

G, B = 24, 4  # the global batch splits into micro-batches of 4 at 1, 2 and 3 ranks


def run_ours(args) -> dict:
    from dlrover_core import load_spec
    from dlrover_core.master.events import read_events
    from dlrover_core.testing import master_node_id, multinode_cluster, run_job

    job_dir = tempfile.mkdtemp(prefix="dlrover-elastic-bench-")
    options = {"replicas": 1, "wait_timeout_s": 60} if args.saver == "flash" else {}
    spec = load_spec({
        "name": "elastic-bench",
        "roles": {"trainer": {"workload": "tests.elastic_workloads:ElasticRegression",
                              "total": 3, "per_node": 1, "nodes": "1:3", "backend": "ddp",
                              "resources": {"cpu": 2}}},
        "checkpoint": {"saver": args.saver, "every_steps": args.ckpt_every, "keep": 2,
                       "options": options},
        "failover": {"standby": False, "survivor_grace_s": 3, "pg_timeout_s": 30},
        "elastic": {"replacement_timeout_s": args.replacement_timeout_s,
                    "poll_interval_s": 1, "global_batch": G, "micro_batch": B},
        "config": {"max_steps": args.steps,
                   "batches_per_shard": 1, "sleep_s": args.step_s}})
    seen: dict = {"removed_ts": None, "added": None}
    with multinode_cluster(workers=3, cpus=2) as (cluster, by_id):

        def resize(st: dict) -> None:
            step = st["instances"].get("trainer-0", {}).get("step", -1)
            if seen["removed_ts"] is None and step >= args.remove_at:
                # a trainer node without the JobMaster (losing that is a master restart)
                master_node = master_node_id(job_dir)
                node_id = next(st["instances"][f"trainer-{r}"]["node_id"] for r in (2, 1, 0)
                               if st["instances"][f"trainer-{r}"]["node_id"] != master_node)
                cluster.remove_node(by_id[node_id])
                seen["removed_ts"] = time.time()
            if seen["removed_ts"] is not None and seen["added"] is None \
                    and step >= args.add_at:
                seen["added"] = cluster.add_node(num_cpus=2).node_id

        summary = run_job(spec, job_dir, resize, timeout=args.timeout_s)
    steps = [{"ts": r["ts"], "world": r.get("world_size")}
             for r in read_events(os.path.join(job_dir, "metrics.jsonl"))
             if r["event"] == "step" and r.get("role", "trainer") == "trainer"]
    summary = summary or {}
    shards = (summary.get("shards") or {}).get("trainer") or {}
    return {"world_sizes": [(w["world_size"], w["step"]) for w in summary.get("world_sizes", [])],
            "samples_lost": summary.get("samples_lost"),
            "samples_duplicated": summary.get("samples_duplicated"),
            "samples_reread_after_rollback": shards.get("samples_reread_after_rollback"),
            "resume_after_loss_s": resume_after(steps, seen["removed_ts"]),
            "goodput": summary.get("goodput"), "status": summary.get("status"),
            "restore_sources": _restore_sources(job_dir), "job_dir": job_dir}


def resume_after(steps: list[dict], removed_ts: float | None) -> float | None:
    """Seconds from ``removed_ts`` to the first step completed after it at a world size
    other than the one of the last step before it (``steps``: ``{"ts", "world"}``), or
    ``None`` (no removal, or no such step)."""
    if removed_ts is None:
        return None
    before = [r for r in steps if r["ts"] <= removed_ts]
    if not before:
        return None
    old = max(before, key=lambda r: r["ts"])["world"]
    after = [r["ts"] for r in steps if r["ts"] > removed_ts and r["world"] != old]
    return round(min(after) - removed_ts, 3) if after else None


def _restore_sources(job_dir: str) -> list:
    path = os.path.join(job_dir, "loads.jsonl")
    return [[ld["world_size"], ld["source"]] for ld in _read(path)]


def _train_fn(cfg: dict) -> None:
    import torch
    import ray.train
    import ray.train.torch

    from dlrover_core.runtime.elastic import ElasticBatch, accumulation_step
    from tests.elastic_math import _data, _model, make_optimizer

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = _model()
    opt = make_optimizer(model)
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            st = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start = st["step"]
    model = ray.train.torch.prepare_model(model)
    plan = ElasticBatch(G, B, world)
    x, y = _data(G * cfg["steps"])

    def mse(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    for step in range(start, cfg["steps"]):
        batches = [(x[r.start:r.stop], y[r.start:r.stop]) for r in plan.micro_ranges(step, rank)]
        accumulation_step(model, opt, batches, mse)
        with open(cfg["log"], "a") as f:
            f.write(json.dumps({"ts": time.time(), "step": step, "world": world,
                                "rank": rank}) + "\n")
        time.sleep(cfg["step_s"])
        if rank == 0 and (step + 1) % cfg["ckpt_every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                inner = model.module if hasattr(model, "module") else model
                torch.save({"model": inner.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1}, os.path.join(d, "state.pt"))
                ray.train.report({"step": step},
                                 checkpoint=ray.train.Checkpoint.from_directory(d))
        else:
            ray.train.report({"step": step})


def run_ray_train(args) -> dict:
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    try:
        import ray
        import ray.train
        from ray.train.torch import TorchTrainer
    except ImportError as exc:
        return {"ray_train_error": f"Ray Train is not installed (pip install -e '.[bench]'): "
                                   f"{exc}"}
    from dlrover_core.testing import multinode_cluster

    state: dict = {}
    with multinode_cluster(workers=3, cpus=2, connect=False) as (cluster, by_id):
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
        log = tempfile.mktemp(prefix="raytrain-elastic-", suffix=".jsonl")
        try:
            scaling = ray.train.ScalingConfig(num_workers=(1, 3), use_gpu=False,
                                              resources_per_worker={"CPU": 2})
        except Exception as exc:  # noqa: BLE001 - a version without elastic ranges
            return {"ray_train_error": f"ScalingConfig(num_workers=(1, 3)) refused: {exc}"}
        trainer = TorchTrainer(
            _train_fn, train_loop_config={"steps": args.steps, "log": log,
                                          "step_s": args.step_s, "ckpt_every": args.ckpt_every},
            scaling_config=scaling,
            run_config=ray.train.RunConfig(
                storage_path=tempfile.mkdtemp(prefix="raytrain-elastic-store-"),
                failure_config=ray.train.FailureConfig(max_failures=3)))

        def fit() -> None:
            try:
                trainer.fit()
            except Exception as exc:  # noqa: BLE001
                state["error"] = f"{type(exc).__name__}: {exc}"[:500]

        th = threading.Thread(target=fit, daemon=True)
        th.start()
        removed_ts = None
        while th.is_alive():
            recs = _read(log)
            if removed_ts is None and any(r["step"] >= args.remove_at for r in recs):
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                victim = next(n for nid, n in by_id.items() if nid in alive)
                cluster.remove_node(victim)
                removed_ts = time.time()
            time.sleep(0.2)
        recs = _read(log)
    steps = [{"ts": r["ts"], "world": r["world"]} for r in recs]
    out = {"ray_train_resume_after_loss_s": resume_after(steps, removed_ts)}
    if "error" in state:
        out["ray_train_error"] = state["error"]
    return out


def _read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--remove-at", type=int, default=20)
    p.add_argument("--add-at", type=int, default=45)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--saver", default="flash", choices=["disk", "flash"])
    p.add_argument("--replacement-timeout-s", type=float, default=2.0)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--skip-ray-train", action="store_true")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs={args.runs}; allowed: an integer >= 1")
    runs = []
    for i in range(args.runs):
        ours = run_ours(args)
        base = {"ray_train_error": "skipped (--skip-ray-train)"} if args.skip_ray_train \
            else run_ray_train(args)
        x, y = ours["resume_after_loss_s"], base.get("ray_train_resume_after_loss_s")
        run = {**ours, **base, "ratio": round(x / y, 3) if x and y else None}
        run.setdefault("ray_train_resume_after_loss_s", None)
        runs.append(run)
        print(f"run {i + 1}/{args.runs}: {json.dumps(run)}", file=sys.stderr, flush=True)
    print(json.dumps(summarize(runs)))
    return 0


FIGURES = ("samples_lost", "samples_duplicated", "samples_reread_after_rollback",
           "resume_after_loss_s", "ray_train_resume_after_loss_s", "ratio", "goodput")


def summarize(runs: list[dict]) -> dict:
    """The medians of :data:`FIGURES` over ``runs`` (``None`` where no run has one), their
    ``spread`` (median, min, max, n) and every run (see the module doc)."""
    spread = {}
    for key in FIGURES:
        vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        spread[key] = {"median": statistics.median(vals) if vals else None,
                       "min": min(vals, default=None), "max": max(vals, default=None),
                       "n": len(vals)}
    return {"world_sizes": [r["world_sizes"] for r in runs],
            **{key: spread[key]["median"] for key in FIGURES},
            "spread": spread, "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
