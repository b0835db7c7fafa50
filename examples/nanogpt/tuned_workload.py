"""nanoGPT with an input pipeline that is the bottleneck, tuned while it trains.

Same model and validation as :mod:`examples.nanogpt.workload`; the training batches
come from :class:`~examples.nanogpt.stored_data.StoredCharWindows` (storage latency
per sample) through an :class:`~dlrover_core.tuning.ElasticDataLoader`. A
:class:`~dlrover_core.tuning.TuningSession` times every step (data wait / compute /
optimizer) and, with ``tuning.enabled``, switches micro-batch, gradient accumulation
and loader workers at a step boundary that all ranks share. The global batch per
rank is ``micro_batch * grad_accum_steps`` (kept by the micro-batch tuner). The loader
position is saved with every checkpoint, so a restarted rank continues the epoch.

A step that runs out of memory under a tuned version is rolled back in place
(:meth:`TuningSession.out_of_memory <dlrover_core.tuning.TuningSession.out_of_memory>`):
the ranks return to the settings before, the loader rewinds to the step's start, and
the step runs again; no process restarts.

Extra config keys: ``micro_batch``, ``grad_accum_steps``, ``num_workers`` (the
starting settings), ``read_latency_s``, ``activation_checkpointing`` (bool),
``memory_budget_bytes`` (0: none; a stand-in for a GPU's memory on a machine without
one: a micro-batch whose activations, estimated by :func:`activation_bytes`, exceed it
raises ``MemoryError`` before its forward pass, as a CUDA allocation would),
``pause_file`` (:mod:`examples.slices`: a benchmark pauses the job between steps), and,
for tests, ``record_samples`` (a directory: each rank appends one JSON line per step with
the sample ids it trained on).
"""

from __future__ import annotations

import json
import os

import torch

from dlrover_core.tuning import ElasticDataLoader, TuningSession, gradient_sync
from examples.char_training import (
    adamw,
    build_char_gpt,
    end_step,
    final_val_loss,
    resume,
    warmup_cosine_lr,
)
from examples.nanogpt.data import CharDataset
from examples.nanogpt.model import Block
from examples.nanogpt.stored_data import StoredCharWindows
from examples.nanogpt.workload import GPTWorkload
from examples.slices import wait_while_paused


#: float32 values one transformer layer keeps for backward per token and unit of width
#: (attention and MLP inputs and outputs, the 4x-wide MLP hidden, layer norms): a rough
#: count, used only by the ``memory_budget_bytes`` stand-in.
ACTIVATION_FLOATS_PER_TOKEN_WIDTH = 16


def activation_bytes(micro_batch: int, block_size: int, n_embd: int, n_layer: int) -> int:
    """Estimated bytes of activations kept for backward by one micro-batch:
    ``micro_batch * block_size * n_embd * n_layer * 16`` float32 values (4 bytes)."""
    return (4 * ACTIVATION_FLOATS_PER_TOKEN_WIDTH * micro_batch * block_size * n_embd
            * n_layer)


class TunedGPTWorkload(GPTWorkload):
    def setup(self) -> None:
        c = self.config
        seed = int(c.get("seed", 1337))
        torch.manual_seed(seed)
        self.data = CharDataset()  # validation batches and the vocabulary
        self.train_set = StoredCharWindows(int(c.block_size),
                                           float(c.get("read_latency_s", 0.002)))
        self.cfg, self.model, self.num_params = build_char_gpt(self, self.data.vocab_size)
        self.opt = adamw(self.model.parameters(), c)
        mb, nw = int(c.get("micro_batch", 8)), int(c.get("num_workers", 0))
        self.loader = ElasticDataLoader(self.train_set, batch_size=mb, num_workers=nw,
                                        seed=seed, rank=self.rank, world_size=self.world_size)
        self.tuning = self.make_tuning_session({
            "dataloader": {"batch_size": mb, "num_workers": nw},
            "optimizer": {"learning_rate": float(c.lr),
                          "grad_accum_steps": int(c.get("grad_accum_steps", 4))},
            "parallelism": {"activation_checkpointing": bool(c.get("activation_checkpointing",
                                                                   False))}})
        resume(self, data=self.loader)
        blocks = [m for m in self.model.modules() if isinstance(m, Block)]
        self.tuning.attach(loader=self.loader, model=self.model, blocks=blocks)
        self._record = None
        if c.get("record_samples"):
            os.makedirs(str(c.record_samples), exist_ok=True)
            self._record = open(os.path.join(str(c.record_samples), f"rank{self.rank}.jsonl"),
                                "a", buffering=1)

    def make_tuning_session(self, initial: dict) -> TuningSession:
        """The rank's tuning session (the JobMaster is its source when tuning is on)."""
        return TuningSession.for_workload(self, initial)

    def lr_at(self, step: int) -> float:
        """The tuned peak learning rate with the warm-up and cosine decay of the base."""
        return warmup_cosine_lr(step, self.tuning.learning_rate, self.config)

    def check_memory_budget(self, micro_batch: int) -> None:
        """Raise ``MemoryError`` when ``micro_batch`` needs more than
        ``config.memory_budget_bytes`` of activations (see the module docstring)."""
        budget = int(self.config.get("memory_budget_bytes", 0) or 0)
        need = activation_bytes(micro_batch, self.cfg.block_size, self.cfg.n_embd,
                                self.cfg.n_layer)
        if budget and need > budget:
            raise MemoryError(f"out of memory: micro-batch {micro_batch} needs about {need} "
                              f"bytes of activations; memory_budget_bytes={budget}")

    def train_step(self, step: int) -> tuple[float, list[int]]:
        """One optimizer step (``grad_accum_steps`` micro-batches); returns the mean
        micro-batch loss and the sample ids trained on."""
        timer, accum = self.tuning.timer, self.tuning.grad_accum_steps
        device = self.backend.device
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(step)
        loss_sum, ids = 0.0, []
        for i in range(accum):
            x, y, sid = self.loader.next_batch(timer)
            self.check_memory_budget(int(x.shape[0]))
            ids += sid.tolist()
            with timer.phase("compute"), gradient_sync(self.model, i == accum - 1):
                _, loss = self.model(x.to(device), y.to(device))
                (loss / accum).backward()
            loss_sum += loss.item()
        with timer.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss_sum / accum, ids

    def run(self) -> dict:
        c = self.config
        max_steps = int(c.max_steps)
        step, val = self.start_step, float("nan")
        while step < max_steps:
            self._maybe_fault(step)
            wait_while_paused(c, self.rank, step, self.tuning.timer)
            self.tuning.boundary(step)
            self.tuning.start_step()
            try:
                loss, ids = self.train_step(step)
            except Exception as exc:  # noqa: BLE001 - re-raised unless out of memory
                if not self.tuning.out_of_memory(exc, step):
                    raise
                self.opt.zero_grad(set_to_none=True)
                continue  # the same step again, on the settings rolled back to
            metrics = {"loss": loss, "lr": self.opt.param_groups[0]["lr"],
                       "peak_lr": self.tuning.learning_rate, **self.tuning.end_step()}
            if self._record is not None:
                self._record.write(json.dumps({"rank": self.rank, "step": step,
                                               "attempt": self.attempt,
                                               "version": self.tuning.version,
                                               "micro_batch": self.tuning.micro_batch,
                                               "epoch": self.loader.epoch, "ids": ids}) + "\n")
            step += 1
            if end_step(self, step, metrics, data=self.loader):
                val = metrics["val_loss"]
        return {"val_loss": final_val_loss(self, step, val), "steps": step,
                "params": self.num_params, "tuning_version": self.tuning.version}

    def teardown(self) -> None:
        self.loader.close()
        if self._record is not None:
            self._record.close()
