"""The same plain torchrun script under ``torchrun`` and under ``dlrover-run``.

For each launcher, ``--runs`` times (alternating launchers): start the script (DDP over
gloo, ``--nproc`` ranks, a small MLP, a snapshot every ``--save-every`` steps that a
restart resumes from); measure

- ``start_to_first_step_s``: from the launcher's start to rank 0's first finished step;
- ``steady_steps_per_s``: rank 0's steps per second between steps ``--warmup`` and
  ``--kill-at`` (before any failure);
- ``recovery_s``: from a SIGKILL of rank 1's script process (right after step
  ``--kill-at``) to rank 0's next finished step in the restarted group
  (``torchrun --max-restarts 1``; ``dlrover-run --max-restarts 1``).

Rank 0 appends ``<step> <unix s> <restart count>`` to a file after each step; the
launchers' own output goes to a log file. The figures of each launcher are the median
over the runs. The last stdout line is one JSON object::

    {"torchrun": {...}, "dlrover_run": {...}, "steady_steps_per_s_ratio": x,
     "recovery_ratio": y, "runs": n, ...}

with ``steady_steps_per_s_ratio`` = dlrover-run's / torchrun's steady steps/s and
``recovery_ratio`` = dlrover-run's / torchrun's recovery seconds. A run whose restarted
group did not finish (the launcher exited non-zero after the kill) gives no
``recovery_s`` (its log is kept and named in ``per_run``) and counts in
``failed_runs``; medians are over the runs that gave a figure, a ratio is ``null``
when a side has none. Each dlrover-run entry of ``per_run`` has ``recovery_phases``:
when the master saw the failure and when it told the scripts to start again (s after
the SIGKILL), and the ``recovery_finished`` event's phases. Goals (issue 22):
ratio of steady steps/s >= 0.97 and recovery ratio <= 0.5, medians of 3 runs.

    python benchmarks/torchrun_overhead.py --runs 3
    python benchmarks/torchrun_overhead.py --smoke      # 1 run, few steps: checks it works
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

SCRIPT = r'''
import argparse, datetime, os, time
import torch, torch.distributed as dist, torch.nn as nn
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int); p.add_argument("--save-every", type=int)
p.add_argument("--snapshot"); p.add_argument("--record"); p.add_argument("--width", type=int)
a = p.parse_args()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
with open(f"{a.record}.pid-{rank}-{restart}", "w") as f:  # for the benchmark's SIGKILL
    f.write(str(os.getpid()))
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(a.width, a.width), nn.ReLU(), nn.Linear(a.width, 1)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
start = 0
if os.path.exists(a.snapshot):
    snap = torch.load(a.snapshot, weights_only=True)
    model.module.load_state_dict(snap["model"]); start = snap["step"]
for step in range(start, a.steps):
    g = torch.Generator().manual_seed(step * 10 + rank)
    x = torch.randn(64, a.width, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if rank == 0:
        with open(a.record, "a") as f:
            f.write(f"{step + 1} {time.time()} {restart}\n")
        if (step + 1) % a.save_every == 0:
            tmp = a.snapshot + ".tmp"
            torch.save({"model": model.module.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, a.snapshot)
    dist.barrier()
dist.destroy_process_group()
'''


def _records(path: Path) -> list[tuple[int, float, int]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.append((int(parts[0]), float(parts[1]), int(parts[2])))
    return out


def _script_pid(record: Path, rank: int) -> int | None:
    """The pid of ``rank``'s first-attempt script process, which the script wrote next
    to ``record`` when it started (``None``: not written)."""
    path = Path(f"{record}.pid-{rank}-0")
    return int(path.read_text()) if path.exists() else None


def run_once(launcher: str, args: argparse.Namespace, work: Path) -> dict:
    """One run of ``launcher`` (``torchrun`` or ``dlrover_run``); its three figures."""
    run_id = f"bench-{launcher.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    d = work / run_id
    d.mkdir()
    script = d / "bench_script.py"
    script.write_text(SCRIPT)
    record = d / "steps.txt"
    bindir = Path(sys.executable).parent
    common = ["--nproc_per_node", str(args.nproc), "--max-restarts", "1", "--rdzv-id", run_id]
    if launcher == "torchrun":
        cmd = [str(bindir / "torchrun"), *common]
    else:
        cmd = [str(bindir / "dlrover-run"), *common, "--quiet", "--job-dir", str(d / "job")]
    cmd += [str(script), "--steps", str(args.steps), "--save-every", str(args.save_every),
            "--snapshot", str(d / "snap.pt"), "--record", str(record),
            "--width", str(args.width)]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    t0 = time.time()
    with open(d / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = t0 + args.timeout
            while time.time() < deadline:
                recs = _records(record)
                if recs and recs[-1][0] >= args.kill_at:
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"{launcher} ended early ({proc.returncode}); see {d}")
                time.sleep(0.01)
            pid = _script_pid(record, 1)
            if pid is None:
                raise RuntimeError(f"{launcher}: rank 1's script process not found")
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            code = proc.wait(timeout=max(1.0, deadline - time.time()))
        finally:
            if proc.poll() is None:
                proc.kill()
    recs = _records(record)
    first = recs[0][1]
    steady = [(s, t) for s, t, r in recs if r == 0 and args.warmup <= s <= args.kill_at]
    (s0, ta), (s1, tb) = steady[0], steady[-1]
    after = [t for s, t, r in recs if r >= 1]
    out = {"start_to_first_step_s": round(first - t0, 3),
           "steady_steps_per_s": round((s1 - s0) / (tb - ta), 2),
           "recovery_s": round(after[0] - t_kill, 3) if after else None,
           "exit_code": code}
    if launcher == "dlrover_run":
        out["recovery_phases"] = _recovery_phases(d / "job" / "events.jsonl", t_kill)
    if code != 0:  # the restarted group did not finish: no recovery figure from this run
        out["recovery_s"] = None
        out["log"] = str(d / "launcher.log")
    return out


def _recovery_phases(events: Path, t_kill: float) -> dict:
    """dlrover-run's recovery, from the job's events: ``failure_seen_s`` (the master's
    ``recovering`` state) and ``restart_sent_s`` (``recovery_finished``: the scripts were
    told to start) in seconds after the SIGKILL, and that event's ``phases``."""
    out: dict = {}
    if not events.exists():
        return out
    for line in events.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "job_state_changed" and ev.get("state") == "recovering" \
                and "failure_seen_s" not in out:
            out["failure_seen_s"] = round(ev["ts"] - t_kill, 3)
        if ev.get("event") == "recovery_finished" and "restart_sent_s" not in out:
            out["restart_sent_s"] = round(ev["ts"] - t_kill, 3)
            out["phases"] = ev.get("phases", {})
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--kill-at", type=int, default=400)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--smoke", action="store_true", help="1 run of 120 steps, kill at 60")
    args = p.parse_args()
    if args.smoke:
        args.runs, args.steps, args.warmup, args.kill_at, args.save_every = 1, 120, 10, 60, 20
    out: dict[str, list[dict]] = {"torchrun": [], "dlrover_run": []}
    tmp = tempfile.mkdtemp(prefix="torchrun-overhead-")  # kept when a run fails
    for i in range(args.runs):
        for launcher in (("torchrun", "dlrover_run") if i % 2 == 0
                         else ("dlrover_run", "torchrun")):
            res = run_once(launcher, args, Path(tmp))
            print(f"run {i} {launcher}: {res}", file=sys.stderr, flush=True)
            out[launcher].append(res)
    if all(r["exit_code"] == 0 for v in out.values() for r in v):
        shutil.rmtree(tmp, ignore_errors=True)
    metrics = ("start_to_first_step_s", "steady_steps_per_s", "recovery_s")
    med = {k: {m: _median([r[m] for r in v]) for m in metrics} for k, v in out.items()}
    for k, v in out.items():
        med[k]["failed_runs"] = sum(r["exit_code"] != 0 for r in v)
    print(json.dumps({
        "torchrun": med["torchrun"], "dlrover_run": med["dlrover_run"],
        "steady_steps_per_s_ratio": _ratio(med["dlrover_run"]["steady_steps_per_s"],
                                           med["torchrun"]["steady_steps_per_s"]),
        "recovery_ratio": _ratio(med["dlrover_run"]["recovery_s"],
                                 med["torchrun"]["recovery_s"]),
        "runs": args.runs, "nproc": args.nproc, "steps": args.steps, "kill_at": args.kill_at,
        "per_run": out}))


if __name__ == "__main__":
    main()
