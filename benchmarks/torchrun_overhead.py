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

with ``steady_steps_per_s_ratio`` = dlrover-run's / torchrun's steady steps/s (the
medians' ratio), ``steady_ratio_per_run`` = that ratio in each run (the two launchers
of a run ran back to back) and ``recovery_ratio`` = dlrover-run's / torchrun's
recovery seconds. A run whose launcher
ended early, whose restarted group did not finish (the launcher exited non-zero after
the kill) or that hung past ``--timeout`` s (stopped: SIGTERM to the launcher, then
SIGKILL to its whole session) gives no ``recovery_s`` and is listed in each launcher's
``failed_runs`` (``{"run", "failed": why, "log": its output}``, the log kept); the
benchmark itself never fails for a launcher's failure. Medians are over the runs that
gave a figure, a ratio is ``null`` when a side has none. Each dlrover-run entry of ``per_run`` has ``recovery_phases``:
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


def _stop(proc: subprocess.Popen, grace_s: float = 45.0) -> None:
    """Stop a launcher that is still running: SIGTERM to the launcher alone (both
    forward it to their ranks; a SIGTERM to its whole session would also end the Ray
    processes that dlrover-run is about to stop the job through), then, after
    ``grace_s`` s, SIGKILL to every process of its session (its workers, an embedded
    Ray). Processes left in the session are SIGKILLed too."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_once(launcher: str, args: argparse.Namespace, work: Path) -> dict:
    """One run of ``launcher`` (``torchrun`` or ``dlrover_run``): its three figures, or
    what it has of them with ``failed`` (why) and ``log`` (the launcher's output) when
    the launcher ended early, failed after the kill, or hung past ``--timeout`` s (then
    it is stopped, :func:`_stop`). Never raises for a launcher's failure."""
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
    t_kill = code = failed = None
    with open(d / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=d, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = t0 + args.timeout
            while time.time() < deadline:
                recs = _records(record)
                if recs and recs[-1][0] >= args.kill_at:
                    break
                if proc.poll() is not None:
                    break
                time.sleep(0.01)
            pid = _script_pid(record, 1)
            if proc.poll() is not None:
                failed = f"ended before step {args.kill_at} (exit code {proc.returncode})"
            elif not (_records(record) and _records(record)[-1][0] >= args.kill_at):
                failed = f"no step {args.kill_at} within --timeout {args.timeout:g} s"
            elif pid is None:
                failed = "rank 1's script process not found"
            else:
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    failed = f"hung after the kill: still running at --timeout {args.timeout:g} s"
        except OSError as exc:  # the script process went away before the kill
            failed = f"{type(exc).__name__}: {exc}"
        finally:
            _stop(proc)
    if code is None:
        code = proc.returncode
    recs = _records(record)
    steady = [(s, t) for s, t, r in recs if r == 0 and args.warmup <= s <= args.kill_at]
    after = [t for s, t, r in recs if r >= 1]
    out = {"start_to_first_step_s": round(recs[0][1] - t0, 3) if recs else None,
           "steady_steps_per_s": None, "recovery_s": None, "exit_code": code}
    if len(steady) >= 2 and steady[-1][1] > steady[0][1]:
        (s0, ta), (s1, tb) = steady[0], steady[-1]
        out["steady_steps_per_s"] = round((s1 - s0) / (tb - ta), 2)
    if launcher == "dlrover_run" and t_kill is not None:
        out["recovery_phases"] = _recovery_phases(d / "job" / "events.jsonl", t_kill)
    if failed is None and code != 0:
        failed = f"the restarted group did not finish (exit code {code})"
    if failed is None and after and t_kill is not None:
        out["recovery_s"] = round(after[0] - t_kill, 3)
    elif failed is None:
        failed = "no step after the kill"
    if failed is not None:  # no recovery figure from this run
        out["failed"] = failed
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
    if not any("failed" in r for v in out.values() for r in v):
        shutil.rmtree(tmp, ignore_errors=True)
    metrics = ("start_to_first_step_s", "steady_steps_per_s", "recovery_s")
    med = {k: {m: _median([r[m] for r in v]) for m in metrics} for k, v in out.items()}
    for k, v in out.items():
        med[k]["failed_runs"] = [{"run": i, "failed": r["failed"], "log": r["log"]}
                                 for i, r in enumerate(v) if "failed" in r]
    print(json.dumps({
        "torchrun": med["torchrun"], "dlrover_run": med["dlrover_run"],
        "steady_steps_per_s_ratio": _ratio(med["dlrover_run"]["steady_steps_per_s"],
                                           med["torchrun"]["steady_steps_per_s"]),
        "recovery_ratio": _ratio(med["dlrover_run"]["recovery_s"],
                                 med["torchrun"]["recovery_s"]),
        "steady_ratio_per_run": [_ratio(d["steady_steps_per_s"], t["steady_steps_per_s"])
                                 for t, d in zip(out["torchrun"], out["dlrover_run"])],
        "runs": args.runs, "nproc": args.nproc, "steps": args.steps, "kill_at": args.kill_at,
        "per_run": out}))


if __name__ == "__main__":
    main()
