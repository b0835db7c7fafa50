"""``make gpu-check``: what only a machine with a CUDA GPU can prove, in one command.

Runs, in order, each under its own time limit (10 minutes in all on one GPU):

1. every ``gpu``-marked test: the core's (``tests/``) and each plugin's
   (``plugins/<name>/tests``, with that plugin's pytest config), ``-m gpu``;
2. the nanoGPT example (``examples/nanogpt/job.yaml``) on CUDA for 200 steps: one
   rank with ``resources.gpu=1`` (and a second when the node has two GPUs);
3. the flash checkpoint benchmark's D2H figure (``benchmarks/flash_checkpoint.py
   --gpu-d2h``: staged copy into shared memory vs ``tensor.to("cpu",
   non_blocking=True)`` into pinned memory).

Writes one JSON report, ``runs/gpu-check/report-<unix time>.json`` (its path is the
last line printed): per part the command, its exit status, seconds, and what it
measured (pytest's counts, the example's summary, the benchmark's JSON line). Exits 1
when a part failed. On a machine without CUDA it prints ``no CUDA device`` and exits 0
(nothing to check; CI keeps passing).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
#: seconds: all gpu tests of one suite / the example / the benchmark
LIMITS = {"tests": 420, "example": 180, "benchmark": 120}
#: the whole check (the issue's 10 minutes on one GPU)
BUDGET_S = 600


def _run(cmd: list[str], timeout: float, log: str) -> tuple[int, float, str]:
    """Run ``cmd`` in the repository root; returns (exit status, seconds, output).
    A command past ``timeout`` s is killed and reported with status 124."""
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, round(time.time() - t0, 1), open(log).read()


def _pytest_counts(out: str) -> dict:
    """``{"passed": n, "failed": n, "skipped": n, ...}`` from pytest's last line."""
    tail = out.strip().splitlines()[-1] if out.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|"
                                             r"deselected)", tail)}


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    out_dir = os.path.join(ROOT, "runs", "gpu-check")
    os.makedirs(out_dir, exist_ok=True)
    stamp = int(time.time())
    started = time.time()
    report: dict = {"device": torch.cuda.get_device_name(0),
                    "gpus": torch.cuda.device_count(), "torch": torch.__version__,
                    "started": stamp, "parts": []}

    def left() -> float:
        return max(10.0, BUDGET_S - (time.time() - started))

    suites = [("core", ["tests"])]
    for cfg in sorted(glob.glob(os.path.join(ROOT, "plugins", "*", "pyproject.toml"))):
        p = os.path.relpath(os.path.dirname(cfg), ROOT)
        suites.append((os.path.basename(p), [f"{p}/tests", "--rootdir", p, "-c",
                                             f"{p}/pyproject.toml"]))
    for name, args in suites:
        cmd = [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *args]
        rc, s, out = _run(cmd, min(LIMITS["tests"], left()),
                          os.path.join(out_dir, f"pytest-{name}-{stamp}.log"))
        counts = _pytest_counts(out)
        ok = rc == 0 or (rc == 5 and not counts.get("failed"))  # 5: no gpu test there
        report["parts"].append({"part": f"gpu tests: {name}", "cmd": cmd, "rc": rc,
                                "seconds": s, "ok": ok, "counts": counts})
        print(f"gpu tests {name}: rc {rc}, {counts}, {s} s", flush=True)

    n = min(2, torch.cuda.device_count())
    job_dir = os.path.join(out_dir, f"nanogpt-{stamp}")
    cmd = [os.path.join(os.path.dirname(PY), "dlrover"), "submit", "examples/nanogpt/job.yaml",
           "--job-dir", job_dir, "--no-progress", "--json", "name=gpu-check-nanogpt",
           f"roles.trainer.total={n}", f"roles.trainer.per_node={n}",
           "roles.trainer.resources.gpu=1", "config.max_steps=200", "config.eval_every=100"]
    rc, s, _ = _run(cmd, min(LIMITS["example"], left()),
                      os.path.join(out_dir, f"nanogpt-{stamp}.log"))
    summary_path = os.path.join(job_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else None
    events = os.path.join(job_dir, "events.jsonl")
    devices = []
    if os.path.exists(events):
        for line in open(events):
            e = json.loads(line)
            if e.get("event") == "instance_started" and e.get("role") == "trainer":
                devices.append({k: e.get(k) for k in ("rank", "gpu_ids", "visible_devices",
                                                      "cuda_device")})
    ok = rc == 0 and bool(summary) and summary.get("status") == "succeeded"
    report["parts"].append({"part": "nanogpt example on cuda, 200 steps", "cmd": cmd,
                            "rc": rc, "seconds": s, "ok": ok, "summary": summary,
                            "devices": devices})
    print(f"nanoGPT on cuda: rc {rc}, {s} s", flush=True)

    cmd = [PY, "benchmarks/flash_checkpoint.py", "--gpu-d2h", "--sizes-mib", "256,1024",
           "--repeat", "5"]
    rc, s, out = _run(cmd, min(LIMITS["benchmark"], left()),
                      os.path.join(out_dir, f"flash-d2h-{stamp}.log"))
    figure = None
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            figure = json.loads(line)
            break
    report["parts"].append({"part": "flash checkpoint D2H", "cmd": cmd, "rc": rc,
                            "seconds": s, "ok": rc == 0 and figure is not None,
                            "figure": figure})
    print(f"flash D2H: rc {rc}, {figure}", flush=True)

    report["seconds"] = round(time.time() - started, 1)
    report["ok"] = all(p["ok"] for p in report["parts"])
    path = os.path.join(out_dir, f"report-{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(path)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
