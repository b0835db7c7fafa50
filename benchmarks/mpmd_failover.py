"""Kill-to-recovery time of MPMD roles: one process SIGKILLed mid-run, from outside.

    .venv/bin/python benchmarks/mpmd_failover.py                 # 3 runs of each kind
    .venv/bin/python benchmarks/mpmd_failover.py --runs 1 --kinds mm_encoder

Kinds (the toy jobs of the plugins' tests, one local Ray cluster for all runs):

- ``mm_encoder``: the multimodal toy (frozen text encoder, trainable vision encoder
  collocated with the trainer, 40 steps, a commit every step, 0.2 s per step), its
  ``text_encoder-0`` killed once the driver reported step 5: a stateless role, replaced
  while the driver keeps running and retries its call.
- ``mm_trainer``: the same job, ``trainer-0`` killed: the trainer is replaced and the
  driver restarts and rolls it back to its last commit.
- ``odl_trainer``: the odl toy stream (960 records in batches of 16, a commit every 5
  steps, 0.03 s per step), ``trainer-0`` killed after 320 records: replaced, restored from
  its last checkpoint, the driver restarted, the source sought back.

Per run, from the master's ``events.jsonl`` and ``metrics.jsonl`` (wall clock, s):
``detect_s`` kill -> ``recovery_started``; ``recovered_s`` kill -> ``recovery_finished``
(the job running again); ``progress_s`` kill -> the first step reported after ``recovery_finished``
(work goes on; a multimodal step is reported after its commit, so this holds a step and
a commit);
``driver_restarted``; ``scope`` (what ``recovery_started`` says is restarted, rolled
back and retried). The last line is one JSON object: per kind, per figure ``{"median",
"min", "max", "n"}`` and every run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time



def mm_spec(name: str):
    from dlrover_core import DLJobBuilder

    toy = "dlrover_plugin_multimodal.toy"
    config = {"multimodal": {
        "data": {"dataset": f"{toy}:ToyPairs", "modalities": ["vec", "tag"]},
        "encoders": {"vision_encoder": {"modality": "vec", "trainable": True},
                     "text_encoder": {"modality": "tag"}},
        "batch_size": 16, "epochs": 10, "evaluate": False},
        "toy": {"step_sleep_s": 0.2}}
    return (DLJobBuilder().name(name).dl_type("MULTIMODAL").config(config)
            .checkpoint(every_steps=1)
            .workload("trainer", toy, "ToyTrainer").resource(cpu=0.3)
            .workload("vision_encoder", toy, "ToyVecEncoder").resource(cpu=0.3)
            .workload("text_encoder", toy, "ToyTextEncoder").resource(cpu=0.3)
            .with_collocation("trainer", "vision_encoder")
            .build().spec)


def odl_spec(name: str, ckpt_dir: str):
    from dlrover_core import load_spec

    toy = "dlrover_plugin_odl.toy"
    return load_spec({
        "name": name, "template": "odl",
        "roles": {"trainer": {"workload": f"{toy}:ToyTrainer", "resources": {"cpu": 0.5}}},
        "checkpoint": {"every_steps": 5, "keep": 2, "dir": ckpt_dir},
        "failover": {"max_restarts": 5},
        "config": {"lr": 0.02, "toy": {"step_sleep_s": 0.03}, "odl": {
            "log_record_ids": True, "batch_size": 16, "buffer": 4, "publish_every": 0,
            "report_every": 1,
            "source": {"kind": "replay", "options": {"records": f"{toy}:toy_records",
                                                      "kwargs": {"n": 960}}}}}})


KINDS = {
    "mm_encoder": ("mm", "text_encoder-0"),
    "mm_trainer": ("mm", "trainer-0"),
    "odl_trainer": ("odl", "trainer-0"),
}


def _jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def one_run(kind: str, job_dir: str) -> dict:
    import ray

    from dlrover_core.master.client import create_master
    from dlrover_core.testing import poll_status

    job, victim = KINDS[kind]
    name = f"fo-{kind.replace('_', '-')}-{os.path.basename(job_dir)}"
    spec = mm_spec(name) if job == "mm" else odl_spec(name, os.path.join(job_dir, "ckpt"))
    master = create_master(spec, job_dir)
    ray.get(master.start.remote())
    try:
        if job == "mm":
            st = poll_status(master, lambda s: s["state"] == "running" and s["step"] >= 5,
                             timeout=300, interval=0.02)
        else:
            st = poll_status(master, lambda s: s["metrics"].get("records", 0) >= 320
                             or s["summary"], timeout=300, interval=0.02)
            assert not st["summary"], "the stream ended before the kill"
        step_at_kill = int(st["step"])
        t_kill = time.time()
        os.kill(st["instances"][victim]["pid"], signal.SIGKILL)
        summary = poll_status(master, lambda s: s["summary"], timeout=600)["summary"]
    finally:
        ray.kill(master, no_restart=True)
    if summary["status"] != "succeeded":
        raise RuntimeError(f"{kind}: the run failed: {summary['error']}")
    events = _jsonl(os.path.join(job_dir, "events.jsonl"))
    rows = [r for r in _jsonl(os.path.join(job_dir, "metrics.jsonl"))
            if r.get("role") == "driver" and "step" in r]
    started = next(e for e in events if e["event"] == "recovery_started")
    finished = next(e for e in events if e["event"] == "recovery_finished")
    after = sorted(r["ts"] for r in rows if r["ts"] > finished["ts"])
    drivers = [e for e in events if e["event"] == "instance_started" and e["role"] == "driver"]
    return {"detect_s": round(started["ts"] - t_kill, 3),
            "recovered_s": round(finished["ts"] - t_kill, 3),
            "progress_s": round(after[0] - t_kill, 3) if after else None,
            "driver_restarted": len(drivers) > 1, "restarts": summary["restarts"]["total"],
            "step_at_kill": step_at_kill, "scope": started.get("scope")}


def spread(values: list) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals),
            "n": len(vals)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the job directories (printed)")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated, of: {', '.join(KINDS)}")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            ap.error(f"--kinds: {k!r} is not one of {', '.join(KINDS)}")
    if args.runs < 1:
        ap.error(f"--runs: {args.runs} is invalid; allowed: an integer >= 1")
    import ray

    from dlrover_core.testing import start_test_ray

    temp = start_test_ray()
    root = tempfile.mkdtemp(prefix="mpmd-failover-")
    out: dict = {}
    try:
        for kind in kinds:
            runs = []
            for i in range(args.runs):
                r = one_run(kind, os.path.join(root, f"{kind}-{i}"))
                print(json.dumps({"kind": kind, "run": i, **r}), file=sys.stderr, flush=True)
                runs.append(r)
            out[kind] = {f: spread([r[f] for r in runs])
                         for f in ("detect_s", "recovered_s", "progress_s")}
            out[kind]["driver_restarted"] = [r["driver_restarted"] for r in runs]
            out[kind]["runs"] = runs
    finally:
        ray.shutdown()
        if args.keep:
            print(f"job directories: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(temp, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
