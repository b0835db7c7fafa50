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

``--runs N`` (default 3) runs each side N times (ours: both paths each time).

Phases of ours (seconds, from the master's ``recovery_started`` / ``recovery_finished``
events and the ``phases`` the latter carries; they add up to the run's recovery time):

- ``detection_s``: kill -> ``recovery_started`` (the monitor sees the dead actor, the
  failure is classified);
- ``abort_s``: survivors abort their collectives and leave the failed run, the failed
  ranks' actors are stopped (the master's ``survivors_s``);
- ``replace_s``: the node-loss probe, a standby promoted or a replacement actor created
  (``replace_and_setup_s`` less the two below; a promoted standby's successor is made
  after the recovery, once the promoted rank reported a step);
- ``actors_started_s``: the replacements' node info and rank 0's rendezvous port;
- ``setup_s``: every rank's ``setup()`` (process group, then the workload's setup,
  which loads the checkpoint); ``setup_import_s``, ``setup_process_group_s`` and
  ``setup_user_s`` are its parts, each the largest over the ranks (so they need not add
  up to ``setup_s``; not added to the sum);
- ``master_other_s``: the rest of ``recovery_started`` -> ``recovery_finished``
  (choosing the action, a driver restart, state changes);
- ``first_step_s``: ``recovery_finished`` -> the first step record (the ranks resume
  their run and complete a step; it can be slightly negative when a step report races
  the event).

A recovery that the master did not run through one process/role restart (e.g. an elastic
shrink) has only ``detection_s``, ``master_other_s`` and ``first_step_s``.

Each side's recovery also less one steady step (``recovery_less_one_step_s``): the time
from the kill to the first step record holds one whole step on each side (the first step
after the recovery), so the median step time of the run before the kill (ours: rank 0's
step records in ``metrics.jsonl``; Ray Train: its ``step_s_median``) is taken off each.

``--backend ddp`` runs our job on DDP: a replaced rank heals from the survivor's live
state (``dlrover_core.checkpoint.heal``) instead of reloading the checkpoint, so no step
is redone (the Ray Train baseline is DDP either way).

The last line of output is one JSON object: ``ours_recovery_s`` (the faster path's median),
``raytrain_recovery_s``, ``ratio`` (ours / Ray Train's, of the medians),
``ratio_less_one_step`` (the same, each side less one steady step), ``steps_redone`` (ours,
the faster path's median), ``ours_steps_redone``, ``raytrain_steps_redone``, the same
figures of both paths
(``ours_in_place_*``, ``ours_restart_all_*``), ``spread`` (per figure ``{"median", "min",
"max", "n"}``, ``n``: runs with a value), ``phases_s`` (per path, per phase the same
spread) and ``runs`` (every run's figures, in order).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
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


#: Phases that add up to a recovery's seconds (see the module doc), in order.
PHASES = ("detection_s", "abort_s", "replace_s", "actors_started_s", "setup_s",
          "master_other_s", "first_step_s")
#: Parts of ``setup_s`` (each the max over ranks; not summed): ours <- the master's key.
SETUP_PARTS = {"setup_import_s": "import_s", "setup_process_group_s": "process_group_s",
               "setup_user_s": "user_setup_s"}
_RESTART_KEYS = ("survivors_s", "replace_and_setup_s", "actors_started_s", "setup_s")


def recovery_phases(kill: float, started: dict, finished: dict | None,
                    first_step: float) -> dict:
    """Seconds of each phase of one recovery: ``kill`` (unix s of the SIGKILL), the
    ``recovery_started`` and ``recovery_finished`` event records (``finished``: ``None``
    when the first step came before any), ``first_step`` (unix s of the first step record
    after ``started``). The :data:`PHASES` present sum to ``first_step - kill``; phases
    the events do not give are ``None``."""
    out: dict = {k: None for k in (*PHASES, *SETUP_PARTS)}
    out["detection_s"] = round(started["ts"] - kill, 3)
    if finished is None:
        out["master_other_s"] = round(first_step - started["ts"], 3)
        return out
    p = finished.get("phases") or {}
    inside = 0.0
    if all(isinstance(p.get(k), (int, float)) for k in _RESTART_KEYS):
        out["abort_s"] = p["survivors_s"]
        out["actors_started_s"], out["setup_s"] = p["actors_started_s"], p["setup_s"]
        out["replace_s"] = round(p["replace_and_setup_s"] - p["actors_started_s"]
                                 - p["setup_s"], 3)
        out.update({k: p.get(m) for k, m in SETUP_PARTS.items()})
        inside = p["survivors_s"] + p["replace_and_setup_s"]
    out["master_other_s"] = round(finished["ts"] - started["ts"] - inside, 3)
    out["first_step_s"] = round(first_step - finished["ts"], 3)
    return out


def analyse(job_dir: str, kill_ts: list[float]) -> dict:
    steps = [r for r in read_jsonl(os.path.join(job_dir, "metrics.jsonl"))
             if r["event"] == "step" and r["role"] == "trainer"]
    counts = collections.Counter(r["step"] for r in steps)
    events = read_jsonl(os.path.join(job_dir, "events.jsonl"))
    started = [e for e in events if e["event"] == "recovery_started"]
    finished = [e for e in events if e["event"] == "recovery_finished"]
    recoveries, phases = [], []
    for k in kill_ts:  # first step completed after the recovery this kill caused began
        begun = [e for e in started if e["ts"] >= k]
        after = [r["ts"] for r in steps if begun and r["ts"] > begun[0]["ts"]]
        if after:
            recoveries.append(after[0] - k)
            done = [e for e in finished if begun[0]["ts"] <= e["ts"] <= after[0]]
            phases.append(recovery_phases(k, begun[0], done[0] if done else None, after[0]))
    rec = [e["seconds"] for e in finished]
    first_kill = min(kill_ts, default=float("inf"))
    ts = sorted({r["step"]: r["ts"] for r in steps if r["ts"] < first_kill}.items())
    gaps = [b[1] - a[1] for a, b in zip(ts, ts[1:]) if b[0] == a[0] + 1]
    return {"recovery_s": recoveries, "steps_redone": sum(c - 1 for c in counts.values()),
            "master_recovery_s": rec, "phases_s": phases,
            "step_s_median": round(statistics.median(gaps), 4) if gaps else None}


def spread(vals: list) -> dict:
    """``{"median", "min", "max", "n"}`` of the numbers in ``vals`` (``None`` s skipped)."""
    xs = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return {"median": round(statistics.median(xs), 3) if xs else None,
            "min": min(xs, default=None), "max": max(xs, default=None), "n": len(xs)}


def less_one_step(recovery_s: float | None, step_s: float | None) -> float | None:
    """``recovery_s`` less one steady step ``step_s`` (``None`` when either is)."""
    if recovery_s is None or step_s is None:
        return None
    return round(recovery_s - step_s, 3)


def run_ours(steps: int, kill_after_step: int, ckpt_every: int, in_place: bool,
             tiny: bool, saver: str = "disk", backend: str = "fsdp") -> dict:
    job_dir = tempfile.mkdtemp(prefix="ours-")
    over = (TINY if tiny else []) + [
        f"name=bench-recovery-{'inplace' if in_place else 'restart'}",
        f"roles.trainer.backend={backend}",
        f"config.max_steps={steps}", f"config.eval_every={steps}",
        f"checkpoint.every_steps={ckpt_every}", f"checkpoint.saver={saver}",
        f"failover.in_place={str(in_place).lower()}", "failover.survivor_grace_s=5"]
    out = run_job(over, job_dir, [{"after_step": kill_after_step}])
    a = analyse(job_dir, out["kill_ts"])
    shutil.rmtree(job_dir, ignore_errors=True)
    s = out["summary"] or {}
    rec = round(a["recovery_s"][0], 3) if a["recovery_s"] else None
    return {"recovery_s": rec, "step_s_median": a["step_s_median"],
            "recovery_less_one_step_s": less_one_step(rec, a["step_s_median"]),
            "steps_redone": a["steps_redone"], "master_recovery_s": a["master_recovery_s"],
            "phases_s": a["phases_s"][0] if a["phases_s"] else None,
            "status": s.get("status"), "steps": s.get("steps"), "wall_s": s.get("wall_s")}


def summarize(runs: list[dict], args: argparse.Namespace) -> dict:
    """The output object (see the module doc) of ``runs``: each ``{"in_place",
    "restart_all"}`` (:func:`run_ours`'s dicts) and ``"raytrain"`` (``run_raytrain``'s,
    ``{}`` when skipped)."""
    paths = {"ours_in_place": "in_place", "ours_restart_all": "restart_all",
             "raytrain": "raytrain"}
    for r in runs:  # Ray Train's recovery less one of its steady steps
        rt_run = r["raytrain"]
        if rt_run and "recovery_less_one_step_s" not in rt_run:
            rt_run["recovery_less_one_step_s"] = less_one_step(rt_run.get("recovery_s"),
                                                               rt_run.get("step_s_median"))
    sp = {f"{name}_{fig}": spread([r[key].get(fig) for r in runs])
          for name, key in paths.items()
          for fig in ("recovery_s", "recovery_less_one_step_s", "steps_redone")}
    phases = {key: {ph: spread([(r[key].get("phases_s") or {}).get(ph) for r in runs])
                    for ph in (*PHASES, *SETUP_PARTS)}
              for key in ("in_place", "restart_all")}
    med = {k: v["median"] for k, v in sp.items()}
    best = min(("in_place", "restart_all"),
               key=lambda k: med[f"ours_{k}_recovery_s"] or 1e9)
    ours, rt = med[f"ours_{best}_recovery_s"], med["raytrain_recovery_s"]
    ours1 = med[f"ours_{best}_recovery_less_one_step_s"]
    rt1 = med["raytrain_recovery_less_one_step_s"]
    return {
        "ours_recovery_s": ours, "ours_path": best,
        "ours_steps_redone": med[f"ours_{best}_steps_redone"],
        "steps_redone": med[f"ours_{best}_steps_redone"],
        "ratio_less_one_step": round(ours1 / rt1, 3) if ours1 and rt1 else None,
        **{k: v for k, v in med.items() if k.startswith("ours_")},
        "raytrain_recovery_s": rt, "raytrain_steps_redone": med["raytrain_steps_redone"],
        "raytrain_version": next((r["raytrain"].get("ray_train_version") for r in runs
                                  if r["raytrain"]), None),
        "ratio": round(ours / rt, 3) if ours and rt else None,
        "steps": args.steps, "kill_after_step": args.kill_after_step,
        "ckpt_every": args.ckpt_every, "model": "tiny" if args.tiny else "demo",
        "saver": args.saver, "backend": getattr(args, "backend", "fsdp"), "runs_n": len(runs), "spread": sp, "phases_s": phases,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-after-step", type=int, default=20)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--saver", default="disk")
    ap.add_argument("--backend", default="fsdp", help="ours: fsdp or ddp (ddp ranks heal)")
    ap.add_argument("--skip-raytrain", action="store_true")
    ap.add_argument("--runs", type=int, default=3, help="runs of each side (>= 1)")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs={args.runs}; allowed: an integer >= 1")
    if args.backend not in ("fsdp", "ddp"):
        ap.error(f"--backend={args.backend!r}; allowed: fsdp, ddp")
    if not args.skip_raytrain:  # before any run, not after the first one
        try:
            import ray.train.torch  # noqa: F401
        except ImportError as exc:
            ap.error(f"the Ray Train baseline needs ray[train], which is not installed "
                     f"({exc}): .venv/bin/pip install \"ray[train]==2.60.0\", or "
                     "--skip-raytrain")
    import ray

    runs = []
    for i in range(args.runs):
        temp = start_ray()
        run: dict = {}
        for key, in_place in (("in_place", True), ("restart_all", False)):
            run[key] = run_ours(args.steps, args.kill_after_step, args.ckpt_every, in_place,
                                args.tiny, args.saver, args.backend)
            print(f"run {i + 1}/{args.runs} ours ({key}):", json.dumps(run[key]), flush=True)
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
        run["raytrain"] = {}
        if not args.skip_raytrain:
            from raytrain_baseline import run_raytrain

            run["raytrain"] = run_raytrain(
                steps=args.steps, kill_after_step=args.kill_after_step,
                ckpt_every=args.ckpt_every, model_size="tiny" if args.tiny else "demo")
            print(f"run {i + 1}/{args.runs} ray train:", json.dumps(run["raytrain"]),
                  flush=True)
        runs.append(run)
    print(json.dumps(summarize(runs, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
