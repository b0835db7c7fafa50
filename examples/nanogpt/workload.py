"""The nanoGPT pre-training workload: one SPMD role under FSDP2 (or DDP).

Each rank trains on its own batches (``batch_size`` windows of ``block_size``
characters), gradients are averaged by the backend; every ``eval_every`` steps the
validation loss is averaged over ranks and reported. Checkpoints go through the
job's saver every ``checkpoint.every_steps``; a restart resumes from the newest.

A step is ``world_size`` micro-batches of ``batch_size`` (one per rank); with the job's
``elastic`` section (``global_batch``, ``micro_batch``) it is ``global_batch /
micro_batch`` micro-batches at any world size, each rank accumulating its share
(:meth:`GPTWorkload.micro_batches`), so a resize changes who trains a micro-batch, not
what it holds. Micro-batch ``j`` of step ``s`` is :meth:`CharDataset.batch` of
``(seed, j, s)``. ``config.grad_clip`` (default 1.0; 0: no clipping) is the gradient
norm clipped to.

``config.record_samples`` (a directory; for the chaos benchmark and tests): each rank
appends to ``rank<r>.jsonl`` one JSON line when it resumes (``{"rank", "attempt",
"pid", "t", "world_size", "resumed_from"}``: the steps done in the state it loaded, 0
for none) and one per micro-batch it trained (``{..., "step", "mb", "loss", "ids"}``:
the micro-batch's index and sample ids, :meth:`CharDataset.sample_ids`); ``t`` is the
unix time of the line.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload
from dlrover_core.tuning import gradient_sync
from examples.char_training import (
    adamw,
    build_char_gpt,
    maybe_fault,
    resume,
    train,
    warmup_cosine_lr,
)
from examples.nanogpt.data import CharDataset


class GPTWorkload(BaseWorkload):
    @classmethod
    def warm_up(cls) -> None:
        """In a standby process: the first AdamW and the data load cost about 1.5 s (the
        encoded corpus stays in the process for ``setup()``: ``CharDataset``)."""
        CharDataset()
        torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())

    def setup(self) -> None:
        c = self.config
        torch.manual_seed(int(c.get("seed", 1337)))
        self.data = CharDataset()
        self.cfg, self.model, self.num_params = build_char_gpt(self, self.data.vocab_size)
        self.opt = adamw(self.model.parameters(), c)
        resume(self)
        self._record = None
        if c.get("record_samples"):
            os.makedirs(str(c.record_samples), exist_ok=True)
            self._record = open(os.path.join(str(c.record_samples), f"rank{self.rank}.jsonl"),
                                "a", buffering=1)
            self._write_record(resumed_from=self.start_step)

    def _write_record(self, **fields) -> None:
        """One line of ``config.record_samples`` (see the module doc)."""
        if getattr(self, "_record", None) is not None:
            self._record.write(json.dumps({"rank": self.rank, "attempt": self.attempt,
                                           "pid": os.getpid(), "t": time.time(),
                                           "world_size": self.world_size, **fields}) + "\n")

    def lr_at(self, step: int) -> float:
        """Linear warm-up for ``warmup_steps``, then cosine decay to ``lr / 10``."""
        return warmup_cosine_lr(step, float(self.config.lr), self.config)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats/char) over ``eval_batches`` batches per rank,
        averaged over ranks."""
        c = self.config
        self.model.eval()
        total = torch.zeros(1, device=self.backend.device)  # NCCL reduces CUDA tensors
        n = int(c.get("eval_batches", 8))
        for i in range(n):
            x, y = self.data.batch("val", int(c.batch_size), self.cfg.block_size, 0, self.rank, i)
            _, loss = self.model(x.to(self.backend.device), y.to(self.backend.device))
            total += loss.detach().float()
        self.model.train()
        total /= n
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= self.world_size
        return float(total)

    _maybe_fault = maybe_fault  # config.fault: the tests' injected faults

    def report(self, step: int, **metrics: float) -> None:
        """:meth:`BaseWorkload.report`, plus ``cuda_max_allocated_mib`` (float, MiB: the
        peak memory this rank's tensors took on its GPU so far) when the rank computes
        on CUDA; ``make gpu-check`` reads it from ``summary.json`` as the proof that the
        example trained on the GPU."""
        device = self.backend.device
        if device.type == "cuda":
            metrics.setdefault("cuda_max_allocated_mib",
                               torch.cuda.max_memory_allocated(device) / 2 ** 20)
        super().report(step, **metrics)

    def micro_batches(self) -> tuple[int, list[int]]:
        """``(samples per micro-batch, this rank's micro-batch indices of a step)``. A
        step is ``world_size x grad_accum_steps`` micro-batches, numbered globally; rank
        ``r`` trains ``r * accum .. (r + 1) * accum - 1``. With the job's ``elastic``
        section (``global_batch``, ``micro_batch``) the accumulation follows the world
        size, so a step trains the same micro-batches, on the same samples, at any
        world size; without it each rank trains one micro-batch of
        ``config.batch_size``, its own index: ``rank``."""
        ctx = self.context
        accum = int(ctx.grad_accum_steps) if ctx.global_batch else 1
        bs = int(ctx.micro_batch) if ctx.global_batch else int(self.config.batch_size)
        return bs, [self.rank * accum + k for k in range(accum)]

    def run(self) -> dict:
        c = self.config
        seed, device = int(c.get("seed", 1337)), self.backend.device
        bs, mine = self.micro_batches()
        clip = float(c.get("grad_clip", 1.0))

        def train_step(step: int) -> float:
            self.opt.zero_grad(set_to_none=True)
            losses = []
            for k, j in enumerate(mine):
                x, y = self.data.batch("train", bs, self.cfg.block_size, seed, j, step)
                with gradient_sync(self.model, k == len(mine) - 1):
                    _, loss = self.model(x.to(device), y.to(device))
                    # 1/accum: an exact power of 2 here, so accumulated gradients are
                    # those of the same micro-batches on more ranks, bit for bit
                    (loss / len(mine) if len(mine) > 1 else loss).backward()
                losses.append(loss.item())
                if getattr(self, "_record", None) is not None:
                    ids = self.data.sample_ids("train", bs, self.cfg.block_size, seed, j, step)
                    self._write_record(step=step, mb=j, loss=losses[-1], ids=ids.tolist())
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.opt.step()
            return sum(losses) / len(losses)

        return train(self, train_step, bs * len(mine) * self.world_size)
