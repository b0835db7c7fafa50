"""Flash checkpoints for HuggingFace ``transformers.Trainer`` (the ``hf`` extra).

    from dlrover_plugin_flashckpt.hf import FlashCheckpointCallback

    flash = FlashCheckpointCallback("runs/ckpt", every_steps=50)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[flash])
    result = flash.train(trainer)  # trainer.train(), resumed from the newest flash save

Every ``every_steps`` optimizer steps (``on_step_end``) the callback copies the model,
optimizer and LR scheduler state, the ``TrainerState`` (as the Trainer writes it to
``trainer_state.json``), the Python, NumPy, torch CPU and CUDA RNG states and the
Trainer's running loss sums into shared memory through a :class:`FlashSaver`, which
returns in memcpy time; the node's persister writes the save to ``directory`` in the
background (``options.persist_every_steps``). At ``on_train_end`` it waits until the
newest save is committed to the directory.

:meth:`FlashCheckpointCallback.train` loads the newest save (from memory when this node
still holds it, else from the directory) and resumes through the Trainer's own
``resume_from_checkpoint`` path: a temporary directory holds the saved
``trainer_state.json`` and ``rng_state.pth``, so the Trainer skips the epochs and the
batches of the current epoch already trained (``skip_first_batches``, unless
``args.ignore_data_skip``) and restores the RNG states where it restores its own; the
model, optimizer and scheduler come from the flash save, not from files. The loss sums
are restored, so the ``training_loss`` that ``train()`` returns and the losses it logs
are those of an uninterrupted run (its speed metrics then count every step since the
run began, over this call's runtime). A loss log due at the saved step itself is not
written again: its steps go into the next log's average. The fp16 gradient scaler is
not saved.

The persister is a Ray actor: run the Trainer inside a Ray worker (a dlrover workload,
where ``saver=self.checkpointer.saver`` reuses the job's saver), in a script under
``dlrover-run`` (the callback joins the cluster named by ``RAY_ADDRESS``, which
``dlrover-run`` sets) or after ``ray.init()``. Tested with transformers 5.3.0 and 5.24.0
and accelerate 1.15 on CPU: in one process (``tests/test_flash_hf.py``) and as two DDP
ranks of a script under ``dlrover-run``, resumed from disk by a second ``dlrover-run``
(``tests/test_flash_hf_ddp.py``).

What the callback touches that is not the Trainer's public API (everything else goes
through ``TrainerCallback`` events and ``resume_from_checkpoint``), none of which a
public API can do:

- ``_total_loss_scalar``, ``_tr_loss`` (filled in place) and ``_globalstep_last_logged``,
  read at a save and written back at ``on_train_begin`` of a resume: the Trainer's
  running loss sums, from which it computes its loss logs and ``training_loss``;
  ``train()`` resets them and no argument or callback sets them. transformers 5.0-5.2
  keep the sum since the last log in a local variable (no ``_tr_loss``): the callback
  refuses them at ``on_train_begin`` (the ``hf`` extra asks for ``>=5.3``).
- ``_initial_global_step``, likewise, where the Trainer has it (5.24 does, 5.3 does
  not): the step ``training_loss`` counts from, reset to the resumed step by
  ``train()``. A Trainer without it divides by ``global_step``, which counts from the
  run's start, so nothing is written there.
- ``_load_from_checkpoint``, replaced on the Trainer instance during :meth:`train`'s
  ``trainer.train`` call: the resume directory holds no model files (the model comes
  from the flash save), and ``resume_from_checkpoint`` would otherwise require them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import tempfile
import time
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerState
from transformers.trainer_callback import ExportableState

log = logging.getLogger(__name__)

#: the Trainer's loss bookkeeping that a resume restores (set before ``on_train_begin``)
_LOSS_ATTRS = ("_total_loss_scalar", "_tr_loss", "_globalstep_last_logged")
#: the step ``training_loss`` counts from, in the Trainers that have it (not 5.3)
_FIRST_STEP_ATTR = "_initial_global_step"


class FlashCheckpointCallback(TrainerCallback):
    """Save and resume a ``transformers.Trainer`` through the flash saver.

    Start training with :meth:`train` (``flash.train(trainer)``), not
    ``trainer.train()``: only :meth:`train` can hand the Trainer the saved step before
    its loop fixes where the data starts.

    Args:
        directory: the checkpoint directory (shared by the nodes of a multi-node run);
            not needed when ``saver`` is given.
        every_steps: save every this many optimizer steps (>= 1).
        saver: an existing :class:`FlashSaver` (e.g. ``self.checkpointer.saver`` in a
            dlrover workload); by default one is made for the Trainer's
            ``process_index`` and ``world_size``.
        job: names the shared-memory buffers and the persister (one per job and node).
        keep: committed steps kept in ``directory``.
        options: ``checkpoint.options`` of the flash saver (``persist_every_steps``,
            ``replicas``, ...); checked like a job spec's.
        resume: load the newest save in :meth:`train` (``False``: start fresh).
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
        #: the step loaded by :meth:`train` (``None``: started fresh)
        self.resumed_from: int | None = None
        #: where it came from: ``memory``, ``disk`` (see ``FlashSaver.last_load_source``)
        self.resumed_source: str | None = None
        #: ``(step, blocking seconds)`` of every save
        self.saves: list[tuple[int, float]] = []
        self._trainer: Any = None  # the Trainer :meth:`train` runs
        self._pending: dict | None = None  # the loaded save, applied at on_train_begin
        self._loaded_model: Any = None  # the model the save was loaded into

    # ---- the entry point -------------------------------------------------------------

    def train(self, trainer: Any, **kwargs: Any) -> Any:
        """Run ``trainer.train(**kwargs)``, resumed from the newest flash save if any.

        Adds this callback to ``trainer`` when it is not there yet. With a save, the
        model is loaded in place before ``trainer.train`` and the optimizer, scheduler
        and loss sums at ``on_train_begin``; the Trainer positions the data and the RNG
        from a temporary ``resume_from_checkpoint`` directory (see the module).

        Args:
            trainer: a ``transformers.Trainer`` (or subclass) without DeepSpeed.
            kwargs: passed to ``trainer.train`` (``trial``, ``ignore_keys_for_eval``).
        Returns:
            ``trainer.train``'s ``TrainOutput`` (``global_step``, ``training_loss``: the
            mean loss of every step since the run began, ``metrics``).
        Raises:
            ValueError: ``resume_from_checkpoint`` is given, or the Trainer uses
                DeepSpeed (its engine loads only its own checkpoints).
            RuntimeError: the save has no Trainer state (another program made it).
            LayoutError, CheckpointLoadError: see ``FlashSaver.load``.
        """
        if kwargs.pop("resume_from_checkpoint", None) not in (None, False):
            raise ValueError("FlashCheckpointCallback.train resumes from the flash save; "
                             "resume_from_checkpoint is not allowed (pass resume=False to "
                             "the callback to start fresh)")
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise ValueError("FlashCheckpointCallback does not support a DeepSpeed Trainer "
                             "(is_deepspeed_enabled=True)")
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        if self.saver is None:
            self.saver = self._make_saver(trainer.args)
        self._trainer = trainer
        try:
            pending = self._load(trainer) if self.resume else None
            if pending is None:
                return trainer.train(**kwargs)
            with tempfile.TemporaryDirectory(prefix="flash-resume-") as d:
                _write_resume_dir(d, pending["trainer"], trainer.args)
                self._pending = pending
                own = trainer._load_from_checkpoint

                def load_from_checkpoint(path: str, model: Any = None) -> None:
                    if path != d:  # the model came from the flash save
                        own(path, model)

                trainer._load_from_checkpoint = load_from_checkpoint
                try:
                    return trainer.train(resume_from_checkpoint=d, **kwargs)
                finally:
                    del trainer._load_from_checkpoint
        finally:
            self._trainer = self._pending = self._loaded_model = None

    def _make_saver(self, args: Any) -> Any:
        import ray
        import torch.distributed as dist

        from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
        from dlrover_plugin_flashckpt.saver import FlashSaver

        if not ray.is_initialized() and os.environ.get("RAY_ADDRESS"):
            from dlrover_plugin_flashckpt.checkpointer import _connect_ray

            _connect_ray()  # a torchrun script under dlrover-run, which sets RAY_ADDRESS
        return FlashSaver(
            SaverConfig(dir=self.directory or "", keep=self.keep, job=self.job,
                        options=self.options),
            SaverContext(rank=int(args.process_index), world_size=int(args.world_size),
                         local_rank=max(0, int(args.local_process_index)), role="trainer",
                         distributed=dist.is_available() and dist.is_initialized()))

    def _load(self, trainer: Any) -> dict | None:
        """The newest save, its model loaded into ``trainer.model`` in place and the rest
        (optimizer, scheduler, trainer) as new objects; ``None`` when there is none."""
        loaded: dict = {"model": trainer.model.state_dict()}
        step = self.saver.load(loaded)
        if step is None:
            log.info("flash checkpoint: no save in %s; training from scratch", self.directory)
            return None
        if not isinstance(loaded.get("trainer"), dict) or "state" not in loaded["trainer"]:
            raise RuntimeError(f"flash checkpoint: the save of step {step} in "
                               f"{self.saver.dir!r} holds no Trainer state (key "
                               "'trainer.state'); it was not made by FlashCheckpointCallback")
        self.resumed_from = step
        self.resumed_source = getattr(self.saver, "last_load_source", None)
        self._loaded_model = trainer.model
        log.info("flash checkpoint: resuming at step %d from %s", step, self.resumed_source)
        return loaded

    # ---- what a save holds -----------------------------------------------------------

    def _state(self, trainer: Any, state: Any, model: Any, optimizer: Any,
               lr_scheduler: Any) -> dict:
        out: dict = {"model": model.state_dict(),
                     "trainer": {"state": _state_json(trainer, state),
                                 "rng": _rng_state(trainer.args),
                                 "loss": {"total": float(trainer._total_loss_scalar),
                                          "since_log": float(trainer._tr_loss.item()),
                                          "last_logged": int(trainer._globalstep_last_logged),
                                          "first_step": int(getattr(trainer, _FIRST_STEP_ATTR, 0))}}}
        if optimizer is not None:
            out["optimizer"] = optimizer.state_dict()
        if lr_scheduler is not None and hasattr(lr_scheduler, "state_dict"):
            out["lr_scheduler"] = lr_scheduler.state_dict()
        return out

    # ---- the Trainer's events --------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError("FlashCheckpointCallback: start training with "
                               "callback.train(trainer), not trainer.train(); only then "
                               "does a resume continue at the next batch")
        missing = [a for a in _LOSS_ATTRS if not hasattr(trainer, a)]
        if missing:
            import transformers

            raise RuntimeError(f"FlashCheckpointCallback: this Trainer (transformers "
                               f"{transformers.__version__}) has no {', '.join(missing)}; "
                               "the callback needs transformers >= 5.3, < 6")
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if model is not None and model is not self._loaded_model:  # model_init made anew
            model.load_state_dict(pending["model"])
        if optimizer is not None and "optimizer" in pending:
            optimizer.load_state_dict(pending["optimizer"])
        if lr_scheduler is not None and "lr_scheduler" in pending:
            lr_scheduler.load_state_dict(pending["lr_scheduler"])
        loss = pending["trainer"].get("loss")
        if loss is not None:
            trainer._total_loss_scalar = float(loss["total"])
            trainer._tr_loss.fill_(float(loss["since_log"]))
            trainer._globalstep_last_logged = int(loss["last_logged"])
            if hasattr(trainer, _FIRST_STEP_ATTR):
                setattr(trainer, _FIRST_STEP_ATTR, int(loss["first_step"]))

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self._trainer is None or model is None or state.global_step % self.every_steps:
            return
        t0 = time.perf_counter()
        self.saver.save(int(state.global_step),
                        self._state(self._trainer, state, model, optimizer, lr_scheduler))
        self.saves.append((int(state.global_step), time.perf_counter() - t0))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.saver is not None:
            self.saver.wait()


def _state_json(trainer: Any, state: Any) -> str:
    """``state`` as the Trainer writes ``trainer_state.json``, with the states of its
    ``ExportableState`` callbacks and its ``TrainerControl`` as of now."""
    data = dataclasses.asdict(state)
    stateful = [cb for cb in trainer.callback_handler.callbacks + [trainer.control]
                if isinstance(cb, ExportableState)]
    data["stateful_callbacks"] = TrainerState(stateful_callbacks=stateful).stateful_callbacks
    return json.dumps(data, sort_keys=True)


def _rng_state(args: Any) -> dict:
    """The RNG states the Trainer saves in ``rng_state.pth`` (Python, NumPy, torch CPU
    and CUDA), NumPy's key as a list of ints (a save holds no NumPy arrays)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    out: dict = {"python": random.getstate(),
                 "numpy": (str(name), [int(k) for k in key], int(pos), int(has_gauss),
                           float(gauss)),
                 "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        from transformers.training_args import ParallelMode

        out["cuda"] = (torch.cuda.random.get_rng_state_all()
                       if args.parallel_mode == ParallelMode.DISTRIBUTED
                       else torch.cuda.random.get_rng_state())
    return out


def _write_resume_dir(directory: str, saved: dict, args: Any) -> None:
    """Write the files of a Trainer checkpoint that position the data and the RNG:
    ``trainer_state.json`` and ``rng_state.pth`` (``rng_state_<process>.pth`` when
    ``args.world_size > 1``), as the Trainer names them."""
    from transformers.trainer import TRAINER_STATE_NAME

    with open(os.path.join(directory, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
        f.write(saved["state"])
    rng = saved.get("rng")
    if rng is None:
        return
    name, key, pos, has_gauss, gauss = rng["numpy"]
    states = {"python": (rng["python"][0], tuple(rng["python"][1]), rng["python"][2]),
              "numpy": (name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss),
              "cpu": rng["cpu"]}
    if "cuda" in rng:
        states["cuda"] = rng["cuda"]
    file = ("rng_state.pth" if int(args.world_size) <= 1
            else f"rng_state_{int(args.process_index)}.pth")
    torch.save(states, os.path.join(directory, file))
