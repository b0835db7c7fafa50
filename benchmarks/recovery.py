"""Recovery benchmark: seconds from a SIGKILL of one worker to the first completed step
after recovery, and steps redone; dlrover-core against Ray Train, same model and data.

    .venv/bin/pip install -e ".[bench]"        # Ray Train for the baseline
    .venv/bin/python benchmarks/recovery.py                  # demo model, 60 steps, kill after 20
    .venv/bin/python benchmarks/recovery.py --tiny --steps 40 --kill-after-step 15

Ours: the nanogpt job (examples/nanogpt/job.yaml, 2 FSDP2 workers), checkpoints every
``--ckpt-every`` steps, run twice: survivors re-form the group in place
(``failover.in_place=true``, the default) and every rank restarted
(``failover.in_place=false``). Ray Train: ``benchmarks/raytrain_baseline.py`` (same
model, data, optimiser, checkpoint interval and kill). Recovery time is measured from
the kill to the first step record after it (the master's ``metrics.jsonl`` for ours,
the workers' step log for Ray Train); steps redone = steps executed twice.

The last line of output is one JSON object with ``ours_recovery_s``,
``raytrain_recovery_s``, ``ratio`` (ours / Ray Train's), ``ours_steps_redone``,
``raytrain_steps_redone``, and the same figures of the restart-every-rank path.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

TINY = ["config.n_layer=1", "config.n_embd=32", "config.n_head=2", "config.block_size=32",
        "config.batch_size=8", "config.eval_batches=1", "config.lr=1e-2",
        "config.warmup_steps=2"]


def start_ray(cpus: int = 3) -> str:
    from dlrover_core.master.client import init_ray

    temp_dir = tempfile.mkdtemp(prefix="dlb", dir="/tmp")
    init_ray(None, num_cpus=cpus, _temp_dir=temp_dir)
    return temp_dir


def read_jsonl(path: str) -> list[dict]:
    from dlrover_core.master.events import read_events

    return read_events(path)


def run_job(overrides: list[str], job_dir: str, kills: list[dict], poll_s: float = 0.05,
            timeout_s: float = 1800) -> dict:
    """Run the nanogpt job for at most ``timeout_s`` (then stop it); ``kills`` are
    {"after_step": s} or {"at_s": t} entries, each SIGKILLs trainer rank 1's process
    once. Returns the summary plus kill times."""
    import ray

    from dlrover_core import load_spec
    from dlrover_core.master.client import create_master

    spec = load_spec(os.path.join(ROOT, "examples/nanogpt/job.yaml"), overrides)
    os.chdir(ROOT)
    master = create_master(spec, job_dir)
    ray.get(master.start.remote())
    t0 = time.time()
    kill_ts: list[float] = []
    pending = list(kills)
    summary = None
    while time.time() - t0 < timeout_s:
        try:
            st = ray.get(master.status.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            time.sleep(poll_s)
            continue
        if st["summary"]:
            summary = st["summary"]
            break
        if pending and st["state"] == "running":
            k = pending[0]
            due = ("after_step" in k and st["step"] >= k["after_step"]) or \
                  ("at_s" in k and time.time() - t0 >= k["at_s"])
            inst = st["instances"].get("trainer-1", {})
            if due and inst.get("state") == "running" and inst.get("pid"):
                os.kill(inst["pid"], signal.SIGKILL)
                kill_ts.append(time.time())
                pending.pop(0)
        time.sleep(poll_s)
    if summary is None:  # time is up: stop the job; its summary says "stopped"
        ray.get(master.stop.remote())
        summary = ray.get(master.wait.remote(120))
    ray.kill(master)
    return {"summary": summary, "kill_ts": kill_ts}


def analyse(job_dir: str, kill_ts: list[float]) -> dict:
    steps = [r for r in read_jsonl(os.path.join(job_dir, "metrics.jsonl"))
             if r["event"] == "step" and r["role"] == "trainer"]
    counts = collections.Counter(r["step"] for r in steps)
    events = read_jsonl(os.path.join(job_dir, "events.jsonl"))
    started = [e["ts"] for e in events if e["event"] == "recovery_started"]
    recoveries = []
    for k in kill_ts:  # first step completed after the recovery this kill caused began
        begun = [t for t in started if t >= k]
        after = [r["ts"] for r in steps if begun and r["ts"] > begun[0]]
        if after:
            recoveries.append(after[0] - k)
    rec = [e["seconds"] for e in events if e["event"] == "recovery_finished"]
    return {"recovery_s": recoveries, "steps_redone": sum(c - 1 for c in counts.values()),
            "master_recovery_s": rec}


def run_ours(steps: int, kill_after_step: int, ckpt_every: int, in_place: bool,
             tiny: bool, saver: str = "disk") -> dict:
    job_dir = tempfile.mkdtemp(prefix="ours-")
    over = (TINY if tiny else []) + [
        f"name=bench-recovery-{'inplace' if in_place else 'restart'}",
        f"config.max_steps={steps}", f"config.eval_every={steps}",
        f"checkpoint.every_steps={ckpt_every}", f"checkpoint.saver={saver}",
        f"failover.in_place={str(in_place).lower()}", "failover.survivor_grace_s=5"]
    out = run_job(over, job_dir, [{"after_step": kill_after_step}])
    a = analyse(job_dir, out["kill_ts"])
    shutil.rmtree(job_dir, ignore_errors=True)
    s = out["summary"] or {}
    return {"recovery_s": a["recovery_s"][0] if a["recovery_s"] else None,
            "steps_redone": a["steps_redone"], "master_recovery_s": a["master_recovery_s"],
            "status": s.get("status"), "steps": s.get("steps"), "wall_s": s.get("wall_s")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-after-step", type=int, default=20)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--saver", default="disk")
    ap.add_argument("--skip-raytrain", action="store_true")
    args = ap.parse_args(argv)
    import ray

    temp = start_ray()
    in_place = run_ours(args.steps, args.kill_after_step, args.ckpt_every, True, args.tiny,
                        args.saver)
    print("ours (in place):", json.dumps(in_place), flush=True)
    restart = run_ours(args.steps, args.kill_after_step, args.ckpt_every, False, args.tiny,
                       args.saver)
    print("ours (restart all ranks):", json.dumps(restart), flush=True)
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
    rt: dict = {}
    if not args.skip_raytrain:
        from raytrain_baseline import run_raytrain

        rt = run_raytrain(steps=args.steps, kill_after_step=args.kill_after_step,
                          ckpt_every=args.ckpt_every, model_size="tiny" if args.tiny else "demo")
        print("ray train:", json.dumps(rt), flush=True)
    best = min((in_place, restart), key=lambda r: r["recovery_s"] or 1e9)
    result = {
        "ours_recovery_s": round(best["recovery_s"], 3) if best["recovery_s"] else None,
        "ours_path": "in_place" if best is in_place else "restart_all",
        "ours_steps_redone": best["steps_redone"],
        "ours_in_place_recovery_s": in_place["recovery_s"],
        "ours_in_place_steps_redone": in_place["steps_redone"],
        "ours_restart_all_recovery_s": restart["recovery_s"],
        "ours_restart_all_steps_redone": restart["steps_redone"],
        "raytrain_recovery_s": rt.get("recovery_s"),
        "raytrain_steps_redone": rt.get("steps_redone"),
        "raytrain_version": rt.get("ray_train_version"),
        "ratio": (round(best["recovery_s"] / rt["recovery_s"], 3)
                  if rt.get("recovery_s") and best["recovery_s"] else None),
        "steps": args.steps, "kill_after_step": args.kill_after_step,
        "ckpt_every": args.ckpt_every, "model": "tiny" if args.tiny else "demo",
        "saver": args.saver,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
