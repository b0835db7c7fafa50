"""Flash checkpoints for HuggingFace ``transformers.Trainer`` (the ``hf`` extra).

    from dlrover_plugin_flashckpt.hf import FlashCheckpointCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[FlashCheckpointCallback("runs/ckpt", every_steps=50)])
    trainer.train()

Every ``every_steps`` optimizer steps (``on_step_end``) the callback copies the model,
optimizer, LR scheduler and trainer counters (``global_step``, ``epoch``, the torch RNG
state) into shared memory through a :class:`FlashSaver`, which returns in memcpy time;
the node's persister writes the save to ``directory`` in the background
(``options.persist_every_steps``). At ``on_train_begin`` it loads the newest save:
from memory when this node still holds it (a restarted process), else from the
directory, and sets ``state.global_step``, so training stops at ``max_steps`` as if
it had not been interrupted. At ``on_train_end`` it waits until the newest save is
committed to the directory.

The Trainer's data loader is not fast-forwarded: the resumed run starts its epoch
from the first batch (the Trainer skips batches only when it resumes from its own
``resume_from_checkpoint`` directory).

The persister is a Ray actor: run the Trainer inside a Ray worker (a dlrover workload,
where ``saver=self.checkpointer.saver`` reuses the job's saver) or after
``ray.init()``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

log = logging.getLogger(__name__)


class FlashCheckpointCallback(TrainerCallback):
    """Save and resume a ``transformers.Trainer`` through the flash saver.

    Args:
        directory: the checkpoint directory (shared by the nodes of a multi-node run);
            not needed when ``saver`` is given.
        every_steps: save every this many optimizer steps (>= 1).
        saver: an existing :class:`FlashSaver` (e.g. ``self.checkpointer.saver`` in a
            dlrover workload); by default one is made at ``on_train_begin`` for the
            Trainer's ``process_index`` and ``world_size``.
        job: names the shared-memory buffers and the persister (one per job and node).
        keep: committed steps kept in ``directory``.
        options: ``checkpoint.options`` of the flash saver (``persist_every_steps``,
            ``replicas``, ...); checked like a job spec's.
        resume: load the newest save at ``on_train_begin``.
    Raises:
        ValueError: ``every_steps`` is not an integer >= 1, or neither ``directory`` nor
            ``saver`` is given.
        SpecError: a bad option.
    """

    def __init__(self, directory: str | None = None, every_steps: int = 100, *,
                 saver: Any = None, job: str = "hf-trainer", keep: int = 2,
                 options: dict | None = None, resume: bool = True) -> None:
        if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps={every_steps!r} is invalid: use an integer >= 1")
        if saver is None and not directory:
            raise ValueError("FlashCheckpointCallback needs directory= (the checkpoint "
                             "directory) or saver= (a FlashSaver)")
        from dlrover_plugin_flashckpt.options import FlashOptions

        FlashOptions.parse(options)
        self.directory, self.every_steps, self.job, self.keep = directory, every_steps, job, keep
        self.options = dict(options or {})
        self.resume = resume
        self.saver = saver
        #: the step loaded at ``on_train_begin`` (``None``: started fresh)
        self.resumed_from: int | None = None
        #: where it came from: ``memory``, ``disk`` (see ``FlashSaver.last_load_source``)
        self.resumed_source: str | None = None
        #: ``(step, blocking seconds)`` of every save
        self.saves: list[tuple[int, float]] = []

    def _make_saver(self, args: Any) -> Any:
        import torch.distributed as dist

        from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
        from dlrover_plugin_flashckpt.saver import FlashSaver

        return FlashSaver(
            SaverConfig(dir=self.directory or "", keep=self.keep, job=self.job,
                        options=self.options),
            SaverContext(rank=int(args.process_index), world_size=int(args.world_size),
                         local_rank=max(0, int(args.local_process_index)), role="trainer",
                         distributed=dist.is_available() and dist.is_initialized()))

    @staticmethod
    def _state(state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> dict:
        out: dict = {"model": model.state_dict(),
                     "trainer": {"global_step": int(state.global_step),
                                 "epoch": float(state.epoch or 0.0),
                                 "rng": torch.get_rng_state()}}
        if optimizer is not None:
            out["optimizer"] = optimizer.state_dict()
        if lr_scheduler is not None and hasattr(lr_scheduler, "state_dict"):
            out["lr_scheduler"] = lr_scheduler.state_dict()
        return out

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.saver is None:
            self.saver = self._make_saver(args)
        if not self.resume or model is None:
            return
        template = self._state(state, model, optimizer, lr_scheduler)
        step = self.saver.load(template)
        if step is None:
            log.info("flash checkpoint: no save in %s; training from scratch", self.directory)
            return
        model.load_state_dict(template["model"])
        if optimizer is not None and "optimizer" in template:
            optimizer.load_state_dict(template["optimizer"])
        if lr_scheduler is not None and "lr_scheduler" in template:
            lr_scheduler.load_state_dict(template["lr_scheduler"])
        state.global_step = int(template["trainer"]["global_step"])
        state.epoch = float(template["trainer"]["epoch"])
        torch.set_rng_state(template["trainer"]["rng"])
        self.resumed_from = step
        self.resumed_source = getattr(self.saver, "last_load_source", None)
        log.info("flash checkpoint: resumed at step %d from %s", step, self.resumed_source)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.saver is None or model is None or state.global_step % self.every_steps:
            return
        import time

        t0 = time.perf_counter()
        self.saver.save(int(state.global_step),
                        self._state(state, model, optimizer, lr_scheduler))
        self.saves.append((int(state.global_step), time.perf_counter() - t0))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.saver is not None:
            self.saver.wait()
