"""The nanoGPT pre-training workload: one SPMD role under FSDP2 (or DDP).

Each rank trains on its own batches (``batch_size`` windows of ``block_size``
characters), gradients are averaged by the backend; every ``eval_every`` steps the
validation loss is averaged over ranks and reported. Checkpoints go through the
job's saver every ``checkpoint.every_steps``; a restart resumes from the newest.

``config.record_samples`` (a directory; for the chaos benchmark and tests): each rank
appends to ``rank<r>.jsonl`` one JSON line when it resumes (``{"rank", "attempt",
"pid", "resumed_from"}``: the steps done in the state it loaded, 0 for none) and one
after each optimizer step (``{"rank", "attempt", "pid", "step", "loss", "ids"}``:
the sample ids trained on, :meth:`CharDataset.sample_ids`).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload
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
                                           "pid": os.getpid(), **fields}) + "\n")

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

    def run(self) -> dict:
        c = self.config
        bs, seed, device = int(c.batch_size), int(c.get("seed", 1337)), self.backend.device

        def train_step(step: int) -> float:
            x, y = self.data.batch("train", bs, self.cfg.block_size, seed, self.rank, step)
            _, loss = self.model(x.to(device), y.to(device))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            if getattr(self, "_record", None) is not None:
                ids = self.data.sample_ids("train", bs, self.cfg.block_size, seed, self.rank,
                                           step)
                self._write_record(step=step, loss=loss.item(), ids=ids.tolist())
            return loss.item()

        return train(self, train_step, bs * self.world_size)
