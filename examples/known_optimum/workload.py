"""A training job whose best loader and micro-batch settings are known in advance: its
costs are sleeps, so its throughput follows a formula (:func:`rate`) and the tuner can
be checked against the optimum (``benchmarks/tuning.py --sliced``).

Costs (``config``):

- ``read_latency_s`` (L): each sample read waits this long, in the loader's worker
  process (:class:`SleepySamples`): ``W`` workers deliver ``W / L`` samples/s
  (``W = 0``: the training process reads, in turn with its compute);
- ``fixed_s`` (F): each micro-batch's forward and backward wait this long, whatever
  its size (a kernel launch and communication cost per micro-batch);
- ``per_sample_s`` (P): and this long per sample of the micro-batch.

A rank's optimizer step is ``S = micro_batch * grad_accum_steps`` samples (kept when the
micro-batch tuner changes the micro-batch), so a rank trains at most
``S / (A * F + S * P)`` samples/s with ``A = S / micro_batch`` micro-batches a step, and
at most ``W / L`` samples/s arrive: :func:`rate` is the smaller of the two, and
:func:`optimum` the best setting within the tuners' bounds. The model is a real,
small one (``Linear(16, 4)`` under the role's backend), so that checkpoints, the
backend's collectives and the tuner's switches are real; its own compute is a small
part of a step's sleeps.

Extra config keys: ``micro_batch``, ``grad_accum_steps``, ``num_workers`` (the start),
``read_latency_s``, ``fixed_s``, ``per_sample_s``, ``max_steps``, ``lr``, ``seed``, and
``pause_file`` (:mod:`examples.slices`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import Dataset

from dlrover_core import BaseWorkload
from dlrover_core.tuning import ElasticDataLoader, TuningSession, gradient_sync
from examples.slices import wait_while_paused

FEATURES, CLASSES = 16, 4


class SleepySamples(Dataset):
    """``n`` samples ``(x float32 [16], y int64, i)``, each read waiting ``read_latency_s``;
    ``x`` and ``y`` are a fixed function of ``i`` (no randomness)."""

    def __init__(self, n: int, read_latency_s: float) -> None:
        if read_latency_s < 0:
            raise ValueError(f"read_latency_s={read_latency_s} is invalid; allowed: >= 0")
        self.n, self.read_latency_s = n, read_latency_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        if self.read_latency_s:
            time.sleep(self.read_latency_s)
        g = torch.Generator().manual_seed(int(i))
        return torch.randn(FEATURES, generator=g), int(i) % CLASSES, int(i)


def rate(num_workers: int, micro_batch: int, samples_per_step: int, read_latency_s: float,
         fixed_s: float, per_sample_s: float) -> float:
    """Samples/s of one rank by the cost model (see the module docstring).

    Raises:
        ValueError: ``micro_batch`` does not divide ``samples_per_step``.
    """
    if samples_per_step % micro_batch:
        raise ValueError(f"micro_batch {micro_batch} does not divide {samples_per_step}")
    s, a = samples_per_step, samples_per_step // micro_batch
    compute = a * fixed_s + s * per_sample_s
    if num_workers == 0:
        return s / (s * read_latency_s + compute)
    return min(num_workers / read_latency_s if read_latency_s else float("inf"), s / compute)


def optimum(config: Any, max_num_workers: int, max_micro_batch: int) -> dict:
    """The best ``(num_workers, micro_batch)`` within the bounds by :func:`rate` (the
    fewest workers and the smallest micro-batch among equal rates), with its rate and
    the starting setting's (samples/s per rank)."""
    s = int(config["micro_batch"]) * int(config["grad_accum_steps"])
    cost = (float(config["read_latency_s"]), float(config["fixed_s"]),
            float(config["per_sample_s"]))
    best = None
    for w in range(max_num_workers + 1):
        for mb in range(1, min(max_micro_batch, s) + 1):
            if s % mb:
                continue
            r = rate(w, mb, s, *cost)
            if best is None or r > best[0] * (1 + 1e-9):
                best = (r, w, mb)
    start = rate(int(config["num_workers"]), int(config["micro_batch"]), s, *cost)
    return {"num_workers": best[1], "micro_batch": best[2], "grad_accum_steps": s // best[2],
            "rate": best[0], "start_rate": start, "samples_per_step": s}


class KnownOptimumWorkload(BaseWorkload):
    def setup(self) -> None:
        c = self.config
        seed = int(c.get("seed", 0))
        torch.manual_seed(seed)
        model = torch.nn.Linear(FEATURES, CLASSES)
        self.model = self.backend.wrap(model) if self.context.backend else model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=float(c.get("lr", 1e-3)))
        mb, nw = int(c.micro_batch), int(c.num_workers)
        self.loader = ElasticDataLoader(SleepySamples(int(c.get("samples", 1 << 20)),
                                                      float(c.read_latency_s)),
                                        batch_size=mb, num_workers=nw, seed=seed,
                                        rank=self.rank, world_size=self.world_size)
        self.tuning = TuningSession.for_workload(self, {
            "dataloader": {"batch_size": mb, "num_workers": nw},
            "optimizer": {"learning_rate": float(c.get("lr", 1e-3)),
                          "grad_accum_steps": int(c.grad_accum_steps)}})
        self.extra = {"step": 0}
        loaded = self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra,
                                        data=self.loader)
        self.start_step = int(self.extra["step"]) if loaded is not None else 0
        self.tuning.attach(loader=self.loader, model=self.model)

    def train_step(self) -> float:
        timer, accum = self.tuning.timer, self.tuning.grad_accum_steps
        fixed, per_sample = float(self.config.fixed_s), float(self.config.per_sample_s)
        loss_sum = 0.0
        for i in range(accum):
            x, y, _ = self.loader.next_batch(timer)
            with timer.phase("compute"), gradient_sync(self.model, i == accum - 1):
                time.sleep(fixed + per_sample * int(x.shape[0]))
                loss = torch.nn.functional.cross_entropy(self.model(x), y)
                (loss / accum).backward()
            loss_sum += float(loss)
        with timer.phase("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss_sum / accum

    def run(self) -> dict:
        step, max_steps = self.start_step, int(self.config.max_steps)
        while step < max_steps:
            wait_while_paused(self.config, self.rank, step, self.tuning.timer)
            self.tuning.boundary(step)
            self.tuning.start_step()
            loss = self.train_step()
            metrics = {"loss": loss, **self.tuning.end_step()}
            step += 1
            self.report(step - 1, **metrics)
            self.extra["step"] = step
            self.checkpointer.maybe_save(step, model=self.model, optimizer=self.opt,
                                         extra=self.extra, data=self.loader)
        return {"steps": step, "tuning_version": self.tuning.version}

    def teardown(self) -> None:
        self.loader.close()
