"""Elastic benchmark: a 3-node ``ray.cluster_utils.Cluster``, one node removed mid-run and
one added back later; how soon training resumes after the loss, against Ray Train v2,
like for like.

    .venv/bin/pip install -e ".[bench]"      # Ray Train for the baseline (optional)
    .venv/bin/python benchmarks/elastic.py --steps 80 --remove-at 20 --add-at 45 --runs 3

Ours: the elastic workload of the tests (``tests/elastic_workloads.py``: a small MLP under
``ddp``, steps from the master's shard service, the global batch kept by gradient
accumulation, the shard state in the checkpoint) as role ``trainer`` with ``nodes:
"1:3"``, one rank per worker node, checkpoints every ``--ckpt-every`` steps (``--saver``,
default ``flash``: the in-memory saver with one replica on another node, so the shrunk
role restores from memory; ``disk``: from the checkpoint folder).

Ray Train: ``TorchTrainer`` with ``ScalingConfig(num_workers=(1, 3))`` (Ray Train v2's
elastic range), the same model, data order and step time, a checkpoint every
``--ckpt-every`` steps to its ``storage_path`` on local disk (it restores from there).
Without Ray Train (the ``bench`` extra) or when its version refuses the range, the JSON
says why (``ray_train_error``) and the baseline figures are ``null``.

**The same settings on both sides.** Each timeout ``T`` of ``--replacement-timeouts``
(default ``60,2``: the default of both, and a short one) is run on both sides: ours
with ``elastic.replacement_timeout_s: T`` (how long the master waits for a replacement
node before it shrinks), Ray Train with ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=T``
(how long its controller waits for a worker group to start; default 60 s); Ray Train's
20 s autoscaling-request interval is a module constant and stays as it is (reported in
``ray_train_settings``). **The same node** is removed on both sides: the node of the
highest rank (on ours, the next one when the JobMaster runs there: losing the master is
a master restart, another scenario; each run says which rank's node went). **Restore
source**: ``restore_sources`` (ours, from each start's load) and
``ray_train_restore_source``.

Both sides measure the same thing: ``resume_after_loss_s`` (ours) and
``ray_train_resume_after_loss_s`` are from the node removal to the first step completed
at a world size other than the one before the removal (ours: a ``step`` record of
``metrics.jsonl``; Ray Train: a line its workers log after each step). A step a survivor
completes at the old world size after the removal does not count.

``--runs N`` (default 3) runs both sides N times per timeout. The last stdout line is
one JSON object: ``by_timeout``: per ``T`` (a string key) the medians over its runs of
``samples_lost``, ``samples_duplicated``, ``samples_reread_after_rollback``,
``resume_after_loss_s``, ``ray_train_resume_after_loss_s``, ``ratio`` (ours / Ray
Train's, per run) and ``goodput``; ``spread`` per figure ``{"median", "min", "max",
"n"}``; ``world_sizes`` and ``runs`` (every run's figures, none left out);
``same_settings``: ``true`` only when every run of that timeout ran both sides with
that timeout and removed the highest rank's node on both; and at the top level
``same_settings`` (every timeout's) and the settings used.
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
RAY_TRAIN_RESTORE_SOURCE = "disk (storage_path checkpoint)"


def victim(rank_nodes: dict[int, str], avoid: str | None = None) -> tuple[str, int]:
    """The node to remove, the same rule on both sides: the node of the highest rank
    (``rank_nodes``: rank -> node id), or of the next highest when that node is
    ``avoid`` (ours: the JobMaster's). Returns ``(node id, rank)``."""
    for rank in sorted(rank_nodes, reverse=True):
        if rank_nodes[rank] != avoid:
            return rank_nodes[rank], rank
    raise ValueError(f"no rank outside node {avoid}: {rank_nodes}")


def run_ours(args, timeout_s: float) -> dict:
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
        "elastic": {"replacement_timeout_s": timeout_s,
                    "poll_interval_s": 1, "global_batch": G, "micro_batch": B},
        "config": {"max_steps": args.steps,
                   "batches_per_shard": 1, "sleep_s": args.step_s}})
    seen: dict = {"removed_ts": None, "added": None, "removed_rank": None, "world": None}
    with multinode_cluster(workers=3, cpus=2) as (cluster, by_id):

        def resize(st: dict) -> None:
            step = st["instances"].get("trainer-0", {}).get("step", -1)
            if seen["removed_ts"] is None and step >= args.remove_at:
                # the highest rank's node, unless the JobMaster runs there (losing that
                # is a master restart, another scenario)
                ranks = {int(k.rsplit("-", 1)[1]): v["node_id"]
                         for k, v in st["instances"].items() if k.startswith("trainer-")}
                node_id, seen["removed_rank"] = victim(ranks, master_node_id(job_dir))
                seen["world"] = len(ranks)
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
            "restore_sources": _restore_sources(job_dir), "job_dir": job_dir,
            "replacement_timeout_s": timeout_s, "removed_rank": seen["removed_rank"],
            "removed_highest_rank": seen["world"] is not None
            and seen["removed_rank"] == seen["world"] - 1}


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
    import ray
    import ray.train.torch

    from dlrover_core.runtime.elastic import ElasticBatch, accumulation_step
    from tests.elastic_math import _data, _model, make_optimizer

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node = ray.get_runtime_context().get_node_id()
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
                                "rank": rank, "node": node}) + "\n")
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


def run_ray_train(args, timeout_s: float) -> dict:
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    # the controller and the workers read it at start-up: this process and the job's env
    env = {"RAY_TRAIN_V2_ENABLED": "1", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{timeout_s:g}"}
    os.environ.update(env)
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
        ray.init(address=cluster.address,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                     p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), **env}})
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
        removed_ts, removed = None, {"rank": None, "world": None}
        deadline = time.time() + args.timeout_s  # the same limit as our job's
        while th.is_alive():
            if time.time() > deadline:
                state["error"] = f"timed out after --timeout-s={args.timeout_s:g} s"
                break
            recs = _read(log)
            if removed_ts is None and any(r["step"] >= args.remove_at for r in recs):
                last = max(recs, key=lambda r: r["ts"])["world"]
                ranks = {r["rank"]: r["node"] for r in recs if r["world"] == last}
                node_id, removed["rank"] = victim(ranks)  # the same rule as ours
                removed["world"] = last
                cluster.remove_node(by_id[node_id])
                removed_ts = time.time()
            time.sleep(0.2)
        recs = _read(log)
    steps = [{"ts": r["ts"], "world": r["world"]} for r in recs]
    from ray.train.v2._internal.execution.scaling_policy import (
        AUTOSCALING_REQUESTS_INTERVAL_S,
    )

    out = {"ray_train_resume_after_loss_s": resume_after(steps, removed_ts),
           "ray_train_removed_rank": removed["rank"],
           "ray_train_removed_highest_rank": removed["world"] is not None
           and removed["rank"] == removed["world"] - 1,
           "ray_train_restore_source": RAY_TRAIN_RESTORE_SOURCE,
           "ray_train_settings": {"worker_group_start_timeout_s": timeout_s,
                                  "autoscaling_requests_interval_s":
                                      AUTOSCALING_REQUESTS_INTERVAL_S}}
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
    p.add_argument("--replacement-timeouts", default="60,2",
                   help="comma-separated seconds; each is run on both sides")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--skip-ray-train", action="store_true")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs={args.runs}; allowed: an integer >= 1")
    try:
        timeouts = [float(t) for t in args.replacement_timeouts.split(",") if t.strip()]
    except ValueError:
        timeouts = []
    if not timeouts or any(t < 0 for t in timeouts):
        p.error(f"--replacement-timeouts={args.replacement_timeouts!r}; allowed: "
                "comma-separated seconds >= 0, e.g. 60,2")
    by_timeout = {}
    for t in timeouts:
        runs = []
        for i in range(args.runs):
            ours = run_ours(args, t)
            base = {"ray_train_error": "skipped (--skip-ray-train)"} if args.skip_ray_train \
                else run_ray_train(args, t)
            x, y = ours["resume_after_loss_s"], base.get("ray_train_resume_after_loss_s")
            run = {**ours, **base, "ratio": round(x / y, 3) if x and y else None}
            run.setdefault("ray_train_resume_after_loss_s", None)
            runs.append(run)
            print(f"timeout {t:g} s, run {i + 1}/{args.runs}: {json.dumps(run)}",
                  file=sys.stderr, flush=True)
        by_timeout[f"{t:g}"] = summarize(runs)
    print(json.dumps({"same_settings": all(v["same_settings"] for v in by_timeout.values()),
                      "replacement_timeouts_s": timeouts, "saver": args.saver,
                      "node_choice": "the highest rank's node on both sides",
                      "by_timeout": by_timeout}))
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
            "same_settings": same_settings(runs), "spread": spread, "runs": runs}


def same_settings(runs: list[dict]) -> bool:
    """True only when every run ran both sides (no ``ray_train_error``) with the same
    replacement timeout and removed the highest rank's node on both."""
    return bool(runs) and all(
        not r.get("ray_train_error") and r.get("removed_highest_rank") is True
        and r.get("ray_train_removed_highest_rank") is True
        and r.get("replacement_timeout_s") is not None
        and (r.get("ray_train_settings") or {}).get("worker_group_start_timeout_s")
        == r.get("replacement_timeout_s") for r in runs)


if __name__ == "__main__":
    sys.exit(main())
