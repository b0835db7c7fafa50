"""The nanoGPT pre-training workload: one SPMD role under FSDP2 (or DDP).

Each rank trains on its own batches (``batch_size`` windows of ``block_size``
characters), gradients are averaged by the backend; every ``eval_every`` steps the
validation loss is averaged over ranks and reported. Checkpoints go through the
job's saver every ``checkpoint.every_steps``; a restart resumes from the newest.
"""

from __future__ import annotations

import math
import os
import signal
import time

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload
from examples.nanogpt.data import CharDataset
from examples.nanogpt.model import GPT, Block, GPTConfig


def adamw(params, config) -> torch.optim.AdamW:
    """The examples' optimizer: AdamW at ``config.lr`` with ``config.weight_decay``
    (default 0.1) and betas (0.9, 0.95), as nanoGPT trains."""
    return torch.optim.AdamW(params, lr=float(config.lr),
                             weight_decay=float(config.get("weight_decay", 0.1)),
                             betas=(0.9, 0.95))


def warmup_cosine_lr(step: int, peak_lr: float, config) -> float:
    """Learning rate at ``step``: linear warm-up over ``config.warmup_steps`` (default 20),
    then cosine decay to ``peak_lr / 10`` at ``config.max_steps``."""
    warm, total = int(config.get("warmup_steps", 20)), int(config.max_steps)
    if step < warm:
        return peak_lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


class GPTWorkload(BaseWorkload):
    @classmethod
    def warm_up(cls) -> None:
        """In a standby process: the first AdamW and the data load cost about 1.5 s."""
        CharDataset()
        torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())

    def setup(self) -> None:
        c = self.config
        torch.manual_seed(int(c.get("seed", 1337)))
        self.data = CharDataset()
        self.cfg = GPTConfig(vocab_size=self.data.vocab_size, block_size=int(c.block_size),
                             n_layer=int(c.n_layer), n_head=int(c.n_head), n_embd=int(c.n_embd))
        model = GPT(self.cfg)
        self.num_params = model.num_params()
        self.model = self.backend.wrap(model, shard_modules=(Block,)) \
            if self.context.backend == "fsdp" else self.backend.wrap(model)
        self.opt = adamw(self.model.parameters(), c)
        self.extra = {"step": 0}
        loaded = self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra)
        self.start_step = int(self.extra["step"]) if loaded is not None else 0
        self.resumed_from = loaded

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

    def _maybe_fault(self, step: int) -> None:
        """Test hook: ``config.fault`` = {"rank": r, "step": s, "kind": raise|kill|hang,
        "attempt": a} injects a real fault in this rank at that step, in restart attempt
        ``a`` only (default 0; ``any``: every attempt, a deterministic bug)."""
        f = self.config.get("fault")
        if not f or int(f.rank) != self.rank or int(f.step) != step:
            return
        attempt = f.get("attempt", 0)
        if attempt != "any" and int(attempt) != self.attempt:
            return
        if f.kind == "raise":
            raise RuntimeError(f"injected fault at step {step}")
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "hang":
            time.sleep(3600)

    def run(self) -> dict:
        c = self.config
        max_steps, bs, eval_every = int(c.max_steps), int(c.batch_size), int(c.eval_every)
        device = self.backend.device
        step = self.start_step
        t_last, val = time.perf_counter(), float("nan")
        while step < max_steps:
            self._maybe_fault(step)
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(step)
            x, y = self.data.batch("train", bs, self.cfg.block_size, int(c.get("seed", 1337)),
                                   self.rank, step)
            _, loss = self.model(x.to(device), y.to(device))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            step += 1
            now = time.perf_counter()
            metrics = {"loss": loss.item(), "lr": self.lr_at(step - 1),
                       "samples_per_s": bs * self.world_size / max(now - t_last, 1e-9)}
            t_last = now
            if step % eval_every == 0 or step == max_steps:
                val = self.evaluate()
                metrics["val_loss"] = val
                t_last = time.perf_counter()
            if self.resumed_from is not None:
                metrics["resumed_from_step"] = self.resumed_from
            self.report(step - 1, **metrics)
            self.extra["step"] = step
            self.checkpointer.maybe_save(step, model=self.model, optimizer=self.opt,
                                         extra=self.extra)
        if math.isnan(val):
            val = self.evaluate()
            self.report(step - 1, val_loss=val)
        return {"val_loss": val, "steps": step, "params": self.num_params}
