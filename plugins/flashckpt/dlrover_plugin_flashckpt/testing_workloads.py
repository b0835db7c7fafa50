"""Workloads used by this plugin's tests (imported by Ray workers, so they live in the
installed package). Not part of the public API."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from dlrover_core import BaseWorkload


class Net(torch.nn.Module):
    """Two blocks, so FSDP2 shards each block and the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(),
                                 torch.nn.Linear(48, 24)) for _ in range(2)])
        self.head = torch.nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    """``path -> value`` of a nested state dict; tensors (local shards of DTensors) cloned."""
    out: dict[str, Any] = {}
    if isinstance(state, torch.Tensor):
        t = state.to_local() if hasattr(state, "to_local") else state
        out[prefix] = t.detach().clone()
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(flatten(v, f"{prefix}.{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(flatten(v, f"{prefix}.{i}"))
    elif state is None or isinstance(state, (int, float, str, bool)):
        out[prefix] = state
    return out


class _CheckpointSpecMixin:
    """Tests started with ``spawn_role`` have no job spec: ``config.ckpt`` stands in for
    the job's ``checkpoint`` section."""

    def _use_ckpt_config(self) -> None:
        ck = self.config.get("ckpt")  # type: ignore[attr-defined]
        if ck is not None:
            from omegaconf import OmegaConf

            self.context.checkpoint = OmegaConf.to_container(ck)  # type: ignore[attr-defined]


class TorchTrainer(_CheckpointSpecMixin, BaseWorkload):
    """``Net`` + AdamW under the role's backend (``ddp`` or ``fsdp``), driven by the
    tests through ``call``."""

    def setup(self) -> None:
        self._use_ckpt_config()
        torch.manual_seed(0)
        net = Net()
        if self.context.backend == "fsdp":
            self.model = self.backend.wrap(net, shard_modules=(torch.nn.Sequential,))
        else:
            self.model = self.backend.wrap(net)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.extra = {"step": 0, "rng": torch.get_rng_state()}

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            g = torch.Generator().manual_seed(100 * self.extra["step"] + self.rank)
            x = torch.randn(16, 24, generator=g)
            loss = torch.nn.functional.cross_entropy(self.model(x), (x[:, 0] > 0).long())
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.extra["step"] += 1
            losses.append(float(loss))
        return losses

    def objects(self) -> dict:
        return {"model": self.model, "optimizer": self.opt, "extra": self.extra}

    def save(self, step: int) -> float:
        return self.checkpointer.save(step, **self.objects())

    def load(self, step: int | None = None) -> dict:
        loaded = self.checkpointer.load(step, **self.objects())
        return {"step": loaded, "source": getattr(self.checkpointer.saver, "last_load_source",
                                                  None)}

    def wait(self) -> None:
        self.checkpointer.wait()

    def flat_state(self) -> dict:
        return flatten(self.checkpointer.engine.state_dict(self.objects()))

    def saver_info(self) -> dict:
        s = self.checkpointer.saver
        return {"skipped": list(getattr(s, "skipped", [])), "paths": list(getattr(s, "paths", [])),
                "pid": os.getpid(), "committed": s.committed_steps()}


class ZeroTrainer(TorchTrainer):
    """``Net`` + AdamW under DeepSpeed ZeRO (``config.stage``, default 2) on the role's
    ``deepspeed`` backend; the state dict comes from the ``deepspeed`` engine."""

    def setup(self) -> None:
        self._use_ckpt_config()
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        self.model = self.backend.wrap(net, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": int(self.config.get("stage", 2))}})
        self.extra = {"step": 0, "rng": torch.get_rng_state()}

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            g = torch.Generator().manual_seed(100 * self.extra["step"] + self.rank)
            x = torch.randn(16, 24, generator=g)
            loss = torch.nn.functional.cross_entropy(self.model(x), (x[:, 0] > 0).long())
            self.model.backward(loss)
            self.model.step()
            self.extra["step"] += 1
            losses.append(float(loss))
        return losses

    def objects(self) -> dict:
        return {"model": self.model, "extra": self.extra}


class CrashAfterSave(_CheckpointSpecMixin, BaseWorkload):
    """A job workload (``run()``): trains ``config.max_steps`` steps of ``Net`` under
    DDP and saves every ``checkpoint.every_steps``. On its first attempt, rank
    ``config.kill_rank`` SIGKILLs itself right after the save of ``config.kill_step``
    (after a barrier, so every rank has saved it). A restarted instance reports where
    its state came from (``resumed_from``, ``from_memory``) and whether the killed step
    reached the disk while it was restarting (``on_disk``, breakpoint save)."""

    def setup(self) -> None:
        torch.manual_seed(0)
        self.model = self.backend.wrap(Net())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.extra = {"step": 0}
        loaded = self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra)
        self.resumed = loaded
        self.source = self.checkpointer.saver.last_load_source
        self.on_disk = -1
        if loaded is not None:  # the breakpoint save runs in the persister: give it time
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                steps = self.checkpointer.saver.committed_steps()
                if steps and steps[-1] >= loaded:
                    self.on_disk = steps[-1]
                    break
                time.sleep(0.1)

    def run(self) -> dict:
        import torch.distributed as dist

        c = self.config
        step = int(self.extra["step"])
        while step < int(c.max_steps):
            g = torch.Generator().manual_seed(100 * step + self.rank)
            x = torch.randn(16, 24, generator=g)
            loss = torch.nn.functional.cross_entropy(self.model(x), (x[:, 0] > 0).long())
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            step += 1
            self.extra["step"] = step
            metrics = {"loss": float(loss)}
            if self.resumed is not None:
                metrics.update(resumed_from=self.resumed, on_disk=self.on_disk,
                               from_memory=float(self.source == "memory"))
            self.report(step - 1, **metrics)
            saved = self.checkpointer.maybe_save(step, model=self.model, optimizer=self.opt,
                                                 extra=self.extra)
            if saved and step == int(c.kill_step) and self.attempt == 0:
                dist.barrier()
                if self.rank == int(c.kill_rank):
                    os.kill(os.getpid(), signal.SIGKILL)
        return {"steps": step}
