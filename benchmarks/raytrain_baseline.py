"""Recovery benchmark, Ray Train side: the nanoGPT example under Ray Train's
``TorchTrainer`` (2 CPU workers, DDP), one worker SIGKILLed mid-run.

Needs Ray Train, which the project's default install does not have::

    .venv/bin/pip install "ray[train]==2.60.0"

(pin the installed ray version; on top of the project's venv it adds only pandas,
pyarrow, python-dateutil, tensorboardX and tzdata, and leaves torch alone; check with
``pip install --dry-run`` first.)

Run::

    .venv/bin/python benchmarks/raytrain_baseline.py --tiny --steps 40 --kill-after-step 15 --ckpt-every 10
    .venv/bin/python benchmarks/raytrain_baseline.py --steps 60 --kill-after-step 20 --ckpt-every 10

The model, data and optimiser are those of ``examples/nanogpt`` (``job.yaml``: 4 layers
x 128 wide, context 128, batch 32 per worker, AdamW 3e-3 with warm-up and cosine decay,
batches a function of (seed, rank, step)); ``--tiny`` uses the tiny config of
``tests/test_nanogpt_job.py``. Each worker appends one JSON line per event to
``<log dir>/rank<r>.jsonl`` (``start``, ``ready``, ``step``, ``ckpt``, ``error``; each
with rank, pid, attempt and a wall-clock ``ts``). A thread in the driver tails those
files, and once step ``kill_after_step`` (0-based) has completed it SIGKILLs rank 1's
worker process. Rank 0 saves model + optimiser + step with ``torch.save`` every
``ckpt_every`` steps and hands it to ``ray.train.report``; a restarted worker resumes
from ``ray.train.get_checkpoint()``.

The last line of output is one JSON object; see ``run_raytrain``.

What Ray Train (2.60, v2 is the default) does here, worth knowing when reading the
numbers:

- On the kill, the survivor's next gloo collective fails at once, but Ray Train only
  acts when its controller next polls the workers (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``,
  default 2 s). It then tears down the whole worker group and starts a new one: new
  placement group, two new worker processes (imports, torch process group), and the
  training function runs again from the top in both ranks.
- A checkpoint counts only once the controller has polled the report off the worker:
  ``report`` writes it to storage and queues it, and the queue holds one entry. So a
  checkpoint reported less than one poll interval before the kill is on disk but not
  registered, and the restart resumes from the one before (``resumed_from`` shows
  which); and reports more often than the poll interval block the training loop
  (``ckpt_report_s_max``).
- ``ray.train.report`` is a barrier: every rank calls it, only rank 0 passes a
  checkpoint.
- Ray is started with ``PYTHONHASHSEED=0`` in its runtime env, because
  ``CharDataset.batch`` seeds its generator with ``hash()`` of a tuple holding a str,
  which differs per process otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# examples/nanogpt/job.yaml, and the tiny config of tests/test_nanogpt_job.py
SIZES = {
    "demo": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=32, lr=3e-3,
                 warmup_steps=20),
    "tiny": dict(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=8, lr=1e-2,
                 warmup_steps=2),
}
SEED = 1337


def _lr_at(step: int, lr: float, warm: int, total: int) -> float:
    """The nanogpt schedule: linear warm-up, then cosine decay to lr / 10."""
    if step < warm:
        return lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _train_fn(cfg: dict) -> dict:
    """Runs in each Ray Train worker."""
    if cfg["repo"] not in sys.path:
        sys.path.insert(0, cfg["repo"])
    import torch

    import ray.train
    import ray.train.torch
    from examples.nanogpt.data import CharDataset
    from examples.nanogpt.model import GPT, GPTConfig

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    path = os.path.join(cfg["log_dir"], f"rank{rank}.jsonl")
    attempt = 0
    if os.path.exists(path):
        with open(path) as f:
            attempt = sum(1 for line in f if '"kind": "start"' in line)
    log = open(path, "a", buffering=1)
    pid = os.getpid()

    def emit(kind: str, **kw) -> None:
        log.write(json.dumps({"kind": kind, "rank": rank, "pid": pid, "attempt": attempt,
                              "ts": time.time(), **kw}) + "\n")
        log.flush()

    emit("start")
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    data = CharDataset()
    gcfg = GPTConfig(vocab_size=data.vocab_size, block_size=cfg["block_size"],
                     n_layer=cfg["n_layer"], n_head=cfg["n_head"], n_embd=cfg["n_embd"])
    model = ray.train.torch.prepare_model(GPT(gcfg))   # DDP (gloo) when world > 1
    inner = getattr(model, "module", model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1,
                            betas=(0.9, 0.95))
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), map_location="cpu")
        inner.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    emit("ready", resumed_from=start if ckpt is not None else None)

    steps, every, bs = cfg["steps"], cfg["ckpt_every"], cfg["batch_size"]
    loss = torch.zeros(())
    step = start
    try:
        for step in range(start, steps):
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, cfg["lr"], cfg["warmup_steps"], steps)
            x, y = data.batch("train", bs, gcfg.block_size, SEED, rank, step)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            emit("step", step=step, loss=round(loss.item(), 4))
            if (step + 1) % every == 0 or step + 1 == steps:
                t0 = time.time()
                metrics = {"step": step, "loss": loss.item()}
                # report() is a barrier: every rank calls it, only rank 0 has a checkpoint
                if rank == 0:
                    with tempfile.TemporaryDirectory(prefix="rtb_ckpt") as d:
                        torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict(),
                                    "step": step + 1}, os.path.join(d, "state.pt"))
                        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
                else:
                    ray.train.report(metrics)
                emit("ckpt", step=step, saved_steps=step + 1, dur=time.time() - t0)
    except BaseException as e:  # noqa: BLE001 - logged, then re-raised
        emit("error", step=step, error=f"{type(e).__name__}: {str(e)[:200]}")
        raise
    finally:
        log.close()
    return {"final_step": steps, "loss": loss.item(), "world": world}


class _Monitor(threading.Thread):
    """Tails the per-rank logs; SIGKILLs rank 1 once step ``kill_after_step`` is done."""

    def __init__(self, log_dir: str, world: int, kill_after_step: int, kill_rank: int = 1):
        super().__init__(daemon=True, name="rtb-monitor")
        self.log_dir, self.world = log_dir, world
        self.kill_after_step, self.kill_rank = kill_after_step, kill_rank
        self.records: list[dict] = []
        self.kill_ts: float | None = None
        self.killed_pid: int | None = None
        self._pos = {r: 0 for r in range(world)}
        self._buf = {r: "" for r in range(world)}
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def _poll(self) -> list[dict]:
        new = []
        for r in range(self.world):
            p = os.path.join(self.log_dir, f"rank{r}.jsonl")
            if not os.path.exists(p):
                continue
            with open(p) as f:
                f.seek(self._pos[r])
                chunk = f.read()
                self._pos[r] = f.tell()
            text = self._buf[r] + chunk
            *lines, self._buf[r] = text.split("\n")
            new.extend(json.loads(line) for line in lines if line.strip())
        return new

    def run(self) -> None:
        while not self._halt.is_set():
            new = self._poll()
            with self._lock:
                self.records.extend(new)
            if self.kill_ts is None:
                done = [r["step"] for r in self.records
                        if r["kind"] == "step" and r["attempt"] == 0]
                pids = [r["pid"] for r in self.records if r["kind"] == "start"
                        and r["rank"] == self.kill_rank and r["attempt"] == 0]
                if done and max(done) >= self.kill_after_step and pids:
                    try:
                        os.kill(pids[0], signal.SIGKILL)
                        self.kill_ts = time.time()
                        self.killed_pid = pids[0]
                    except ProcessLookupError:
                        self.kill_ts = float("nan")
            time.sleep(0.005)

    def stop(self) -> list[dict]:
        self._halt.set()
        self.join(timeout=5)
        with self._lock:
            self.records.extend(self._poll())
            return list(self.records)


def _ray_train_version() -> str:
    try:
        from ray.train.v2._internal.constants import is_v2_enabled
        return "v2" if is_v2_enabled() else "v1"
    except ImportError:
        return "v1"


def _controller_phases(ray_temp: str | None, kill_ts: float) -> dict:
    """Best effort (v2 only): when the Train controller logged the failure decision and
    the new worker group, from its JSON log in the Ray session we started."""
    if not ray_temp:
        return {}
    out = {}
    for path in glob.glob(os.path.join(ray_temp, "session_*", "logs", "train",
                                       "ray-train-app-controller-*.log")):
        try:
            with open(path) as f:
                lines = [json.loads(line) for line in f if line.startswith("{")]
        except (OSError, ValueError):
            continue
        for rec in lines:
            try:
                ts = datetime.datetime.strptime(rec["asctime"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            except (KeyError, ValueError):
                continue
            msg = rec.get("message", "")
            if ts < kill_ts - 0.01:
                continue
            if "[FailurePolicy]" in msg:
                out.setdefault("controller_failure_decision", round(ts - kill_ts, 3))
            elif msg.startswith("Attempting to start training worker group"):
                out.setdefault("controller_starting_group", round(ts - kill_ts, 3))
            elif msg.startswith("Started training worker group"):
                out.setdefault("controller_group_started", round(ts - kill_ts, 3))
    return out


def _analyse(recs: list[dict], kill_ts: float | None, fit_t0: float,
             ray_temp: str | None = None) -> dict:
    steps0 = [r for r in recs if r["kind"] == "step" and r["rank"] == 0]
    out: dict = {}
    if steps0:
        out["final_step"] = max(r["step"] for r in steps0) + 1
        out["startup_s"] = round(min(r["ts"] for r in steps0 if r["attempt"] == 0) - fit_t0, 3)
    attempts = {r["attempt"] for r in recs if r["kind"] == "start"}
    out["failures"] = max(attempts) if attempts else 0
    # median step time per rank-0 step in the first attempt (excludes checkpoint steps)
    a0 = sorted((r for r in steps0 if r["attempt"] == 0), key=lambda r: r["step"])
    gaps = [b["ts"] - a["ts"] for a, b in zip(a0, a0[1:])]
    if gaps:
        out["step_s_median"] = round(statistics.median(gaps), 4)
    ck = [r["dur"] for r in recs if r["kind"] == "ckpt" and r["rank"] == 0]
    if ck:
        out["ckpt_report_s_median"] = round(statistics.median(ck), 4)
        out["ckpt_report_s_max"] = round(max(ck), 4)
    if kill_ts is None or math.isnan(kill_ts):
        return out
    before = [r["step"] for r in recs if r["kind"] == "step" and r["attempt"] == 0]
    max_before = max(before)
    out["max_step_before_kill"] = max_before
    after = [r for r in steps0 if r["attempt"] >= 1]
    if after:
        out["recovery_s"] = round(min(r["ts"] for r in after) - kill_ts, 3)
    ready = [r for r in recs if r["kind"] == "ready" and r["attempt"] == 1]
    resumed = next((r["resumed_from"] for r in ready if r["rank"] == 0), None)
    out["resumed_from"] = resumed or 0
    out["resumed_from_checkpoint"] = resumed is not None
    out["steps_redone"] = max_before + 1 - (resumed or 0)
    # phases, seconds after the kill
    ph = {}
    err = [r["ts"] for r in recs if r["kind"] == "error" and r["attempt"] == 0]
    if err:
        ph["survivor_error"] = round(min(err) - kill_ts, 3)
    st = [r["ts"] for r in recs if r["kind"] == "start" and r["attempt"] == 1]
    if st:
        ph["new_workers_started"] = round(max(st) - kill_ts, 3)
    ph.update(_controller_phases(ray_temp, kill_ts))
    if ready:
        ph["resumed"] = round(max(r["ts"] for r in ready) - kill_ts, 3)
    if after:
        ph["first_step"] = out["recovery_s"]
    out["phases_s"] = dict(sorted(ph.items(), key=lambda kv: kv[1]))
    out["new_pids"] = sorted({r["pid"] for r in recs if r["kind"] == "start" and r["attempt"] == 1})
    return out


def run_raytrain(steps: int = 60, kill_after_step: int = 20, ckpt_every: int = 10,
                 model_size: str = "demo", num_workers: int = 2, keep: bool = False) -> dict:
    """Train nanoGPT under Ray Train with ``num_workers`` CPU workers, SIGKILL rank 1
    after 0-based step ``kill_after_step`` has completed (``kill_after_step < 0``: no
    kill), let Ray Train restart the run from its last checkpoint, and return:

    ``recovery_s``: seconds from the kill to the first rank-0 step completed after the
    restart; ``steps_redone``: (max step completed before the kill + 1) - the step the
    run resumed from; ``total_wall_s``: ``trainer.fit()`` wall time; ``failures``: the
    restarts Ray Train did; ``final_step``: steps completed at the end (== ``steps``
    on success); ``ray_train_version``: "v1" or "v2"; plus ``phases_s`` (survivor
    error / new workers started / checkpoint loaded / first step, seconds after the
    kill), ``resumed_from``, ``step_s_median``, ``ckpt_report_s_median``,
    ``startup_s`` (fit start to first step) and ``ray_init_s``.
    """
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    if model_size not in SIZES:
        raise ValueError(f"model_size must be one of {sorted(SIZES)}")
    work = tempfile.mkdtemp(prefix="rtb_run", dir="/tmp")
    log_dir, store = os.path.join(work, "log"), os.path.join(work, "store")
    os.makedirs(log_dir)
    os.makedirs(store)
    started, ray_temp = False, None
    t0 = time.time()
    if not ray.is_initialized():
        ray_temp = tempfile.mkdtemp(prefix="rtb", dir="/tmp")
        # PYTHONHASHSEED: CharDataset.batch seeds with hash((seed, rank, step, "train")),
        # and a str hash differs per process unless this is fixed.
        ray.init(num_cpus=num_workers + 1, include_dashboard=False,
                 _temp_dir=ray_temp,
                 runtime_env={"env_vars": {"PYTHONHASHSEED": "0"}})
        started = True
    ray_init_s = time.time() - t0
    if __name__ != "__main__" and __name__ in sys.modules:
        # workers may not be able to import this file as a module: ship it by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    cfg = dict(SIZES[model_size], steps=steps, ckpt_every=ckpt_every, log_dir=log_dir,
               repo=REPO)
    trainer = TorchTrainer(
        _train_fn,
        train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=False,
                                               resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(
            name=f"rtb_{model_size}_{int(time.time())}", storage_path=store,
            failure_config=ray.train.FailureConfig(max_failures=3)),
    )
    mon = _Monitor(log_dir, num_workers, kill_after_step if kill_after_step >= 0 else 10**9)
    mon.start()
    error = None
    fit_t0 = time.time()
    try:
        trainer.fit()
    except Exception as e:  # noqa: BLE001 - reported in the result
        error = f"{type(e).__name__}: {str(e)[:300]}"
    total = time.time() - fit_t0
    recs = mon.stop()
    res = {"recovery_s": None, "steps_redone": None, "total_wall_s": round(total, 3),
           "failures": 0, "final_step": 0}
    res.update(_analyse(recs, mon.kill_ts, fit_t0, ray_temp))
    res.update(ray_train_version=_ray_train_version(), ray_version=ray.__version__,
               model_size=model_size, steps=steps, kill_after_step=kill_after_step,
               ckpt_every=ckpt_every, num_workers=num_workers, killed_pid=mon.killed_pid,
               ray_init_s=round(ray_init_s, 3), error=error)
    if started:
        ray.shutdown()
    if keep:
        res["work_dir"], res["ray_temp_dir"] = work, ray_temp
    else:
        shutil.rmtree(work, ignore_errors=True)
        if ray_temp:
            shutil.rmtree(ray_temp, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-after-step", type=int, default=20,
                    help="0-based step after which rank 1 is SIGKILLed; negative: no kill")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="the tiny model of the tests")
    ap.add_argument("--keep", action="store_true", help="keep logs and checkpoints")
    a = ap.parse_args(argv)
    res = run_raytrain(a.steps, a.kill_after_step, a.ckpt_every,
                       "tiny" if a.tiny else "demo", keep=a.keep)
    sys.stdout.flush()
    sys.stderr.flush()
    print(json.dumps(res), flush=True)
    return 0 if res.get("error") is None and res.get("final_step") == a.steps else 1


if __name__ == "__main__":
    sys.exit(main())
