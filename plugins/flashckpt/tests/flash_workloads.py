"""Workloads used by this plugin's tests; not installed (the workers of a test's Ray
cluster import them as ``plugins.flashckpt.tests.flash_workloads``: the current
directory, the repository's root, is on their ``PYTHONPATH``)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from dlrover_core import BaseWorkload
from dlrover_core.runtime.elastic import accumulation_step
from dlrover_core.testing.tensors import flatten_state


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


def toy_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step`` for :class:`Net`: inputs ``[16, 24]`` float32
    (seeded by step and rank) and their classes ``[16]`` int64 (feature 0 > 0)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 24, generator=g)
    return x, (x[:, 0] > 0).long()


def toy_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean cross entropy of ``model`` on a :func:`toy_batch` (a scalar tensor)."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def use_ckpt_config(workload: BaseWorkload) -> None:
    """Tests started with ``spawn_role`` have no job spec: ``config.ckpt`` stands in for
    the job's ``checkpoint`` section."""
    ck = workload.config.get("ckpt")
    if ck is not None:
        from omegaconf import OmegaConf

        workload.context.checkpoint = OmegaConf.to_container(ck)


class TorchTrainer(BaseWorkload):
    """``Net`` + AdamW under the role's backend (``ddp`` or ``fsdp``), driven by the
    tests through ``call``."""

    def setup(self) -> None:
        use_ckpt_config(self)
        torch.manual_seed(0)
        net = Net()
        if self.context.backend == "fsdp":
            self.model = self.backend.wrap(net, shard_modules=(torch.nn.Sequential,))
        else:
            self.model = self.backend.wrap(net)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.extra = {"step": 0, "rng": torch.get_rng_state()}

    def train(self, steps: int) -> list[float]:
        """``steps`` optimizer steps (:meth:`step`) on :func:`toy_batch`; their
        losses."""
        losses = []
        for _ in range(steps):
            losses.append(self.step(toy_batch(self.extra["step"], self.rank)))
            self.extra["step"] += 1
        return losses

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One AdamW step on ``batch``; its loss averaged over the ranks."""
        return accumulation_step(self.model, self.opt, [batch], toy_loss)

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
        return flatten_state(self.checkpointer.engine.state_dict(self.objects()))

    def full_state(self) -> dict:
        """``path -> value`` of the state with every DTensor gathered to its full tensor
        (a collective: call on every rank at once)."""

        def full(v: Any) -> Any:
            if hasattr(v, "full_tensor"):
                return v.full_tensor()
            if isinstance(v, dict):
                return {k: full(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return type(v)(full(x) for x in v)
            return v

        return flatten_state(full(self.checkpointer.engine.state_dict(self.objects())))

    def saver_info(self) -> dict:
        s = self.checkpointer.saver
        return {"skipped": list(getattr(s, "skipped", [])), "paths": list(getattr(s, "paths", [])),
                "pid": os.getpid(), "committed": s.committed_steps()}


class ZeroTrainer(TorchTrainer):
    """``Net`` + AdamW under DeepSpeed ZeRO (``config.stage``, default 2) on the role's
    ``deepspeed`` backend; the state dict comes from the ``deepspeed`` engine."""

    def setup(self) -> None:
        use_ckpt_config(self)
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        self.model = self.backend.wrap(net, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": int(self.config.get("stage", 2))}})
        self.extra = {"step": 0, "rng": torch.get_rng_state()}

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One step of the DeepSpeed engine on ``batch``; this rank's loss."""
        loss = toy_loss(self.model, batch)
        self.model.backward(loss)
        self.model.step()
        return float(loss)

    def objects(self) -> dict:
        return {"model": self.model, "extra": self.extra}


class CrashAfterSave(BaseWorkload):
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
            loss = accumulation_step(self.model, self.opt, [toy_batch(step, self.rank)],
                                     toy_loss)
            step += 1
            self.extra["step"] = step
            metrics = {"loss": loss}
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


def rank_state(rank: int, step: int, n: int = 1 << 16) -> dict:
    """A deterministic state of ``rank`` at ``step`` (``step < 0``: zeros)."""
    if step < 0:
        return {"model": {"w": torch.zeros(n), "b": torch.zeros(7, dtype=torch.bfloat16)},
                "extra": {"step": -1}}
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"model": {"w": torch.randn(n, generator=g),
                      "b": torch.randn(7, generator=g).to(torch.bfloat16)},
            "extra": {"step": step}}


class SaverRank:
    """One rank's ``FlashSaver`` in its own Ray actor, without a process group (the
    ranks agree at load through the gather board,
    :mod:`dlrover_plugin_flashckpt.agreement`); for tests that place ranks on nodes
    themselves."""

    def __init__(self, job: str, directory: str, rank: int, world_size: int,
                 options: dict) -> None:
        from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
        from dlrover_plugin_flashckpt.saver import FlashSaver

        self.rank = rank
        self.saver = FlashSaver(SaverConfig(dir=directory, keep=2, job=job, options=options),
                                SaverContext(rank=rank, world_size=world_size, role="trainer"))

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def save(self, step: int) -> None:
        self.saver.save(step, rank_state(self.rank, step))

    def wait(self) -> None:
        self.saver.wait()

    def attempt(self) -> dict | None:
        """The attempt this rank's saves will name (drawn by the last load)."""
        a = self.saver.attempts
        return a.current or (a.next[0] if a.next else None)

    def load(self, step: int | None = None) -> dict:
        got = rank_state(self.rank, -1)
        step = self.saver.load(got, step=step)
        want = rank_state(self.rank, step) if step is not None else None
        exact = want is not None and all(torch.equal(got["model"][k], want["model"][k])
                                         for k in want["model"]) \
            and got["extra"] == want["extra"]
        return {"step": step, "source": self.saver.last_load_source, "exact": exact}


def hf_train(directory: str, job: str, max_steps: int, every_steps: int,
             kill_at: int = -1) -> dict:
    """Train a tiny GPT-2 (built from a config, nothing downloaded, dropout on) with
    ``transformers.Trainer`` through ``FlashCheckpointCallback.train``: 24 distinct
    samples (sample ``i`` starts with token ``i``), shuffled anew every epoch, 2 per
    batch, 2 batches per optimizer step (6 steps an epoch), a loss log every 3 steps.
    Returns the callback's resume, the state at train begin (after it) and at every
    step end, the sample ids in the order the model saw them, the loss logs, the
    returned ``training_loss`` and the committed steps. ``kill_at``: the process
    SIGKILLs itself at the end of that step (after the flash callback's save)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from dlrover_plugin_flashckpt.hf import FlashCheckpointCallback
    from plugins.flashckpt.tests.hf_ddp_script import tiny_gpt2

    model, data, seen = tiny_gpt2(layers=2, width=32, vocab=64, length=16, samples=24)

    def snapshot(model: Any, optimizer: Any, lr_scheduler: Any, state: Any) -> dict:
        return {"step": int(state.global_step),
                "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optimizer": flatten_state(optimizer.state_dict()["state"]),
                "lr": list(lr_scheduler.get_last_lr())}

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.begin: dict | None = None
            self.steps: list[dict] = []

        def on_train_begin(self, args, state, control, model=None, optimizer=None,
                           lr_scheduler=None, **kw):
            self.begin = snapshot(model, optimizer, lr_scheduler, state)

        def on_step_end(self, args, state, control, model=None, optimizer=None,
                        lr_scheduler=None, **kw):
            self.steps.append(snapshot(model, optimizer, lr_scheduler, state))
            if state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    flash = FlashCheckpointCallback(directory, every_steps=every_steps, job=job,
                                    options={"wait_timeout_s": 120})
    probe = Probe()
    args = TrainingArguments(output_dir=os.path.join(directory, "..", "hf-out"),
                             max_steps=max_steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-2,
                             warmup_steps=2, lr_scheduler_type="linear", logging_steps=3,
                             save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[flash, probe])
    out = flash.train(trainer)
    return {"resumed_from": flash.resumed_from, "source": flash.resumed_source,
            "saves": [s for s, _ in flash.saves], "begin": probe.begin, "steps": probe.steps,
            "seen": seen, "training_loss": out.training_loss,
            "logs": [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e],
            "committed": flash.saver.committed_steps()}
