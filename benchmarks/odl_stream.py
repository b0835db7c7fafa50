"""Throughput and CPU of an ``odl`` stream against one process doing the same work.

    .venv/bin/python benchmarks/odl_stream.py [--stream-s 30] [--warmup-s 5] [--runs 3]

Records: the Shuttle stream (``examples/odl_shuttle``, river's bundled copy, time
order; ``--records`` > 0 keeps the first that many), replayed in a loop
(``shuttle_records(loops=0)``) so that the stream outlasts the dataset. Both sides run
``--warmup-s + --stream-s`` seconds and are measured over the last ``--stream-s``
(the first ``--warmup-s`` are left out: actor start, the first checkpoint, the
first report). Per run, in this order, on one local Ray cluster:

- ``single_process``: one process (spawned for the run, so its CPU is its own) doing
  the job's work: reads chunks of ``chunk_batches * batch_size`` records, preprocesses
  them (signed log), runs the prequential step per batch (score, then one Adam
  step; the same model and learning rate), scores each chunk with the newest
  published model (reloaded from disk when a newer one appears, as the ``eval`` role
  does), saves a checkpoint (the core's ``disk`` saver, ``async_save``: model,
  optimizer, the stream progress as ``extra``) every ``--checkpoint-every-s`` and
  publishes a model version (:func:`dlrover_plugin_odl.publish.publish`) every
  ``--publish-every-s``, by its own clock;
- ``odl``: the ``examples/odl_shuttle/job.yaml`` job (source, 2 preprocess workers,
  trainer, eval) with ``config.odl.checkpoint_every_s`` / ``publish_every_s`` at the same
  cadence (``checkpoint.every_steps`` and ``publish_every`` past the stream's end, so
  only the clock asks) and ``max_time_s`` = warmup + stream. Its window starts at the
  first driver report at least ``--warmup-s`` after the driver's loop started (that
  start is the first report's time less its ``records / records_per_s``) and ends at
  its last report; records are the driver's ``records``.

Figures per run: ``*_records_per_s`` (records trained in the window / its seconds),
``*_cpu_us_per_record`` (CPU microseconds, user + system, in the window / its records: for
the job, summed over every process of the benchmark's Ray cluster (GCS, raylet, the
job's master, driver and role actors, Ray's other daemons), sampled every
0.25 s (a process that ends keeps its last sample); for the one process, its own),
``ratio`` = odl / single_process records/s and ``cpu_per_record_ratio`` = odl /
single_process CPU per record, and each side's checkpoints and publishes in its
window (``*_checkpoints``, ``*_publishes``; the same cadence: about the same counts).
The job's CPU by process (the command line's first word, over the whole run: a process
that outlives runs, such as the raylet, from the run's start) goes to stderr.

The last line is one JSON object: each figure as ``{"median", "min", "max", "runs"}``
over the runs, ``runs`` with every run's figures, ``stream_s`` (the job's measured
window, median). The machine is
shared; compare figures within one run of this script.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAMPLE_S = 0.25


def single_process(out: multiprocessing.Queue, limit: int, lr: float, hidden: int,
                   batch: int, chunk_batches: int, warmup_s: float, stream_s: float,
                   ckpt_every_s: float, publish_every_s: float, work: str) -> None:
    """The one-process peer (see the module docstring); puts a dict of its figures
    on ``out``. Runs in a spawned process."""
    import torch
    from dlrover_plugin_odl.publish import latest_version, load_latest, publish
    from dlrover_plugin_odl.steps import prequential_step

    from dlrover_core.checkpoint.checkpointer import Checkpointer
    from dlrover_core.checkpoint.disk import DiskSaver
    from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
    from dlrover_core.runtime.role_state import OptimizerState
    from examples.odl_shuttle.data import shuttle_records
    from examples.odl_shuttle.workload import build_model, features

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, scorer = build_model(hidden), build_model(hidden)
    scorer.eval()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    saver = Checkpointer(DiskSaver(SaverConfig(dir=os.path.join(work, "ckpt"), keep=2,
                                               options={"async_save": True}), SaverContext()))
    pub_dir = os.path.join(work, "published")
    stream = shuttle_records(limit, loops=0)
    size = batch * chunk_batches
    step = records = correct = eval_correct = 0
    version = None
    saves: list[float] = []
    publishes: list[float] = []
    start = time.monotonic()
    last_save = last_pub = start
    mark = None   # (t, records, cpu) at the end of the warmup
    while True:
        now = time.monotonic()
        if mark is None and now - start >= warmup_s:
            mark = (now, records, time.process_time())
        if now - start >= warmup_s + stream_s:
            break
        if ckpt_every_s and now - last_save >= ckpt_every_s and step:
            last_save = now
            saver.save(step, model=model, optimizer=OptimizerState.for_checkpointer(
                saver, model, opt), extra={"stream": json.dumps({"step": step,
                                                                  "records": records})})
            saves.append(now)
        rows = [next(stream) for _ in range(size)]
        x = features([r["x"] for r in rows])
        y = torch.tensor([r["y"] for r in rows])
        latest = latest_version(pub_dir)
        if latest is not None and latest != version:
            got = load_latest(pub_dir)
            if got is not None:
                scorer.load_state_dict(got[1])
                version = got[0]
        if version is not None:
            with torch.no_grad():
                eval_correct += int((scorer(x).argmax(-1) == y).sum())
        for i in range(0, size, batch):
            xb, yb = x[i:i + batch], y[i:i + batch]
            pred, _ = prequential_step(model, opt, {"x": xb, "y": yb},
                                       lambda m, b: m(b["x"]).argmax(-1),
                                       lambda m, b: torch.nn.functional.cross_entropy(
                                           m(b["x"]), b["y"]))
            correct += int((pred == yb).sum())
            step += 1
        records += size
        if publish_every_s and time.monotonic() - last_pub >= publish_every_s:
            last_pub = time.monotonic()
            publish(pub_dir, step, model.state_dict(), {"step": step, "records": records})
            publishes.append(last_pub)
    end = (time.monotonic(), records, time.process_time())
    saver.saver.wait()
    saver.saver.close()
    n = end[1] - mark[1]
    out.put({"records_per_s": n / (end[0] - mark[0]), "cpu_s_per_record": (end[2] - mark[2]) / n,
             "eval_correct": eval_correct,
             "window_s": end[0] - mark[0], "records": n,
             "checkpoints": sum(1 for t in saves if t >= mark[0]),
             "publishes": sum(1 for t in publishes if t >= mark[0]),
             "prequential_accuracy": correct / max(records, 1)})


def run_single(args, raw, work: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    odl = raw.config.odl
    p = ctx.Process(target=single_process, args=(
        q, args.records, float(raw.config.lr), int(raw.config.hidden), int(odl.batch_size),
        int(odl.chunk_batches), args.warmup_s, args.stream_s, args.checkpoint_every_s,
        args.publish_every_s, work))
    p.start()
    try:
        got = q.get(timeout=args.warmup_s + args.stream_s + 300)
    finally:
        p.join(60)
    if p.exitcode != 0:
        raise RuntimeError(f"the single process exited with {p.exitcode}")
    return got


class CpuSampler:
    """CPU seconds (user + system) of every process below this one (the local Ray
    cluster it started), sampled every :data:`SAMPLE_S`: ``samples`` of (unix time,
    cumulative CPU s). A process keeps its last sample after it ends."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self.last: dict[tuple[int, float], tuple[str, float]] = {}
        self.base: dict[tuple[int, float], float] = {}
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        import psutil

        for p in self._me.children(recursive=True):
            try:
                key = (p.pid, p.create_time())
                t = p.cpu_times()
                # the newest name: a Ray worker retitles itself for its actor
                name = (p.cmdline() or [p.name()])[0].split("/")[-1].split(" ")[0]
                self.last[key] = (name, t.user + t.system)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self.samples.append((time.time(), sum(v for _, v in self.last.values())))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> CpuSampler:
        self._sample()
        self.base = {k: v for k, (_, v) in self.last.items()}
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, ts: float) -> float:
        """Cumulative CPU s at unix time ``ts`` (linear between the samples around it)."""
        before = [s for s in self.samples if s[0] <= ts]
        after = [s for s in self.samples if s[0] >= ts]
        if not before or not after:
            raise ValueError(f"no CPU samples around {ts}")
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (ts - t0) / (t1 - t0)

    def by_name(self) -> dict[str, float]:
        """CPU s per process name since :meth:`__enter__` (a process that was already
        running then, such as the raylet of a cluster several runs share, counts from
        its CPU at that moment)."""
        out: dict[str, float] = {}
        for key, (name, v) in self.last.items():
            out[name] = round(out.get(name, 0.0) + v - self.base.get(key, 0.0), 2)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def job_window(job_dir: str, warmup_s: float) -> tuple[dict, dict]:
    """The first and last driver rows of the window (see the module docstring)."""
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("role") == "driver"
                and "records" in r]
    first = rows[0]
    start = first["ts"] - first["records"] / first["records_per_s"]
    inside = [r for r in rows if r["ts"] >= start + warmup_s]
    if len(inside) < 2:
        raise RuntimeError(f"fewer than 2 driver reports after the {warmup_s} s warmup")
    return inside[0], inside[-1]


def events_between(job_dir: str, event: str, t0: float, t1: float) -> int:
    with open(os.path.join(job_dir, "events.jsonl")) as f:
        return sum(1 for e in map(json.loads, f) if e["event"] == event and t0 <= e["ts"] <= t1)


def versions_between(job_dir: str, t0: float, t1: float) -> int:
    """Model versions that appeared in the driver's ``published_version`` in ``(t0, t1]``."""
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("role") == "driver"
                and "published_version" in r]
    before = max([r["published_version"] for r in rows if r["ts"] <= t0], default=-1)
    return len({r["published_version"] for r in rows
                if t0 < r["ts"] <= t1 and r["published_version"] > before})


def spread(values: list[float], nd: int = 1) -> dict:
    return {"median": round(statistics.median(values), nd), "min": round(min(values), nd),
            "max": round(max(values), nd), "runs": [round(v, nd) for v in values]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=0,
                   help="records of the dataset replayed in the loop (0: all 49,097)")
    p.add_argument("--stream-s", type=float, default=30.0, help="measured seconds")
    p.add_argument("--warmup-s", type=float, default=5.0, help="seconds left out first")
    p.add_argument("--checkpoint-every-s", type=float, default=1.0)
    p.add_argument("--publish-every-s", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()

    from omegaconf import OmegaConf

    from dlrover_core import load_spec
    from dlrover_core.master.client import init_ray, submit_job

    temp = tempfile.mkdtemp(prefix="dlrb", dir="/tmp")
    raw = OmegaConf.load("examples/odl_shuttle/job.yaml")
    odl = raw.config.odl
    odl.source.options.kwargs.limit = args.records
    odl.source.options.kwargs.loops = 0
    odl.log_record_ids = False
    odl.max_time_s = args.warmup_s + args.stream_s
    odl.checkpoint_every_s = args.checkpoint_every_s
    odl.publish_every_s = args.publish_every_s
    odl.publish_every = 10 ** 9
    raw.checkpoint.every_steps = 10 ** 9
    init_ray(None, _temp_dir=temp)
    runs = []
    try:
        for k in range(args.runs):
            base = run_single(args, raw, os.path.join(temp, f"single{k}"))
            spec = load_spec(raw, [f"name=odl-bench-{k}"])
            job_dir = os.path.join(temp, f"job{k}")
            with CpuSampler() as cpu:
                summary = submit_job(spec, job_dir=job_dir, progress=False)
            if summary["status"] != "succeeded":
                print(f"run {k}: job {summary['status']}: {summary.get('error')}",
                      file=sys.stderr)
                return 1
            a, b = job_window(job_dir, args.warmup_s)
            n, secs = b["records"] - a["records"], b["ts"] - a["ts"]
            job_cpu = (cpu.at(b["ts"]) - cpu.at(a["ts"])) / n
            runs.append({
                "single_process_records_per_s": round(base["records_per_s"], 1),
                "odl_records_per_s": round(n / secs, 1),
                "ratio": round(n / secs / base["records_per_s"], 4),
                "single_process_cpu_us_per_record": round(base["cpu_s_per_record"] * 1e6, 2),
                "odl_cpu_us_per_record": round(job_cpu * 1e6, 2),
                "cpu_per_record_ratio": round(job_cpu / base["cpu_s_per_record"], 4),
                "stream_s": round(secs, 2), "single_process_window_s": round(base["window_s"], 2),
                "odl_records": int(n), "single_process_records": int(base["records"]),
                "odl_checkpoints": events_between(job_dir, "checkpoint_saved", a["ts"], b["ts"]),
                "single_process_checkpoints": base["checkpoints"],
                "odl_publishes": versions_between(job_dir, a["ts"], b["ts"]),
                "single_process_publishes": base["publishes"],
                "job_wall_s": round(summary["wall_s"], 1)})
            print(json.dumps({"run": k, **runs[-1], "cpu_s_by_process": cpu.by_name()}),
                  file=sys.stderr, flush=True)
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    out = {"benchmark": "odl_stream", "runs": runs, "n_runs": len(runs),
           "batch_size": int(odl.batch_size), "chunk_batches": int(odl.chunk_batches),
           "checkpoint_every_s": args.checkpoint_every_s,
           "publish_every_s": args.publish_every_s, "warmup_s": args.warmup_s,
           "stream_s": statistics.median(r["stream_s"] for r in runs)}
    for key in ("odl_records_per_s", "single_process_records_per_s",
                "odl_cpu_us_per_record", "single_process_cpu_us_per_record"):
        out[key] = spread([r[key] for r in runs])
    for key in ("ratio", "cpu_per_record_ratio"):
        out[key] = spread([r[key] for r in runs], 4)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
