"""``FusionTrainerWorkload``: the base class of the ``trainer`` role.

You provide, in a subclass:

- :meth:`FusionTrainerWorkload.build_model`: the fusion model / projector, given the
  trainable encoders' networks (built from their roles' ``build_encoder``) in an
  ``nn.ModuleDict`` keyed by modality, so that they train with it;
- :meth:`FusionTrainerWorkload.compute_loss`: the loss of one batch;
- optionally :meth:`FusionTrainerWorkload.build_optimizer` (default AdamW with
  ``config.lr``, 1e-3) and :meth:`FusionTrainerWorkload.evaluate_batch`.

A batch is a dict: ``ids`` (``[n]`` int64 sample ids) and, per modality, the frozen
encoder's ``[n, d]`` float32 embeddings or the trainable encoder's preprocessed
inputs (the model runs that encoder itself).

The role is SPMD under the role's backend (``roles.trainer.backend``: ``ddp``,
``fsdp``, ...): each rank trains on its contiguous share of a step's samples and
the backend's wrapper averages the gradients. Without a backend it must have one
rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from dlrover_core.plugins.records import resolve
from dlrover_plugin_multimodal.encoder import MultimodalWorkload
from dlrover_plugin_multimodal.handoff import EncodedRefs, chunk_bounds, fetch_rows


class UpstreamLost(RuntimeError):
    """An encoder's output of this step could not be fetched on some trainer rank
    (the encoder failed or its process died); no rank trained on the step."""


class FusionTrainerWorkload(MultimodalWorkload):
    """The ``trainer`` role (see the module docstring).

    Attributes (after ``setup``):
        encoders: ``nn.ModuleDict`` modality -> trainable encoder network.
        model: what :meth:`build_model` returned, wrapped by the backend.
        optimizer: from :meth:`build_optimizer`.
        step: optimizer steps taken (the driver restores a restarted trainer to its
            last commit, :meth:`restore_state`).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    # ------------------------------------------------------------------ override
    def build_model(self, encoders: torch.nn.ModuleDict) -> torch.nn.Module:
        """The trained model, containing ``encoders`` (modality -> trainable encoder
        network). Override."""
        raise NotImplementedError(f"{type(self).__name__}.build_model(encoders)")

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """Default: ``AdamW(lr=config.lr or 1e-3, weight_decay=config.weight_decay or
        0.01)`` over every parameter that requires a gradient."""
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=float(self.config.get("lr", 1e-3)),
                                 weight_decay=float(self.config.get("weight_decay", 0.01)))

    def compute_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """``(loss, metrics)`` of one batch: a scalar tensor with gradients, and
        scalars to report (averaged over ranks by the driver). Override."""
        raise NotImplementedError(f"{type(self).__name__}.compute_loss(batch)")

    def evaluate_batch(self, batch: dict[str, Any]) -> dict[str, float]:
        """Metrics on the dataset's ``eval_inputs`` (one batch per modality, with
        ``<modality>_split`` and ``<modality>_ids`` beside it). Runs on every rank with
        the whole batch, under ``torch.no_grad``, the model in eval mode; the driver
        reports rank 0's metrics. Default: nothing."""
        return {}

    # ------------------------------------------------------------------ lifecycle
    def setup(self) -> None:
        self.init_torch()
        if self.world_size > 1 and self._backend is None:
            raise RuntimeError(f"roles.trainer.total={self.world_size} needs a backend to "
                               "average gradients; set roles.trainer.backend (e.g. ddp)")
        _ = self.dataset
        encoders = torch.nn.ModuleDict()
        for enc in self.mm.trainable:
            cls = resolve(enc.workload)
            encoders[enc.modality] = cls.build_encoder(self.config)
        self.encoders = encoders
        model = self.build_model(encoders)
        self.model = self.backend.wrap(model) if self._backend is not None else model
        self.optimizer = self.build_optimizer(self.model)
        # what the driver's commit holds besides the model and the optimizer: steps
        # taken and samples trained (the whole step's, the same on every rank)
        self.extra = {"step": 0, "samples": 0}
        self.step = 0

    # ------------------------------------------------------------------ state at commits
    def state_objects(self) -> dict[str, Any]:
        """What the driver's commit holds of this rank (``save_state`` /
        ``restore_state`` of ``BaseWorkload``): the model, the optimizer, ``extra``
        (``step``, ``samples``) and this rank's torch RNG (dropout, augmentations), under
        a key of its own per rank (``rng_<rank>``)."""
        from dlrover_core.runtime.role_state import OptimizerState, TorchRNG

        optimizer = OptimizerState.for_checkpointer(self.role_state.checkpointer, self.model,
                                                    self.optimizer)
        return {"model": self.model, "optimizer": optimizer, "extra": self.extra,
                f"rng_{self.rank}": TorchRNG()}

    def restore_state(self, step: int) -> int | None:
        """Back to the driver's committed ``step`` (0: ``setup()`` again)."""
        out = super().restore_state(step)
        self.step = int(self.extra["step"])
        if self.step != int(step):
            raise RuntimeError(f"trainer-{self.rank}: restored step {step} holds "
                               f"extra.step={self.step}")
        return out

    def commit_interval(self) -> int:
        """Steps between the driver's commits: ``checkpoint.every_steps``, or 1 (every
        step) when it is 0."""
        return int(self.context.checkpoint.get("every_steps") or 0) or 1

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The model inside the backend's wrapper."""
        return getattr(self.model, "module", self.model)

    # ------------------------------------------------------------------ driver calls
    def trained_steps(self) -> int:
        """Optimizer steps taken so far: where a (re)started driver resumes."""
        return int(self.step)

    def train_step(self, step: int, ids: Sequence[int],
                   inputs: dict[str, EncodedRefs]) -> dict[str, float]:
        """Train on this rank's share of step ``step``: fetch its rows of every
        modality from the encoders, ``compute_loss``, backward, optimizer step. The
        driver checkpoints the trainer at its commits (``save_state``).

        Returns ``metrics`` plus ``step_s`` and ``fetch_s`` (seconds), ``samples``
        (this rank's) and ``trained_samples`` (samples of every step this model has
        trained on, since step 0: restored with the commit, so counted once).

        Raises:
            ValueError: ``step`` is not the next step of this trainer (it has taken
                ``trained_steps()`` steps).
            UpstreamLost: some rank could not fetch an encoder's output (every rank
                raises it together, so none waits in a collective).
        """
        t0 = time.perf_counter()
        if int(step) != self.step:
            raise ValueError(f"train_step({step}): this trainer has taken {self.step} steps; "
                             f"the next is {self.step}")
        batch = self._fetch(ids, inputs)
        t_fetch = time.perf_counter() - t0
        self.model.train()
        loss, metrics = self.compute_loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        self.extra["step"] = self.step
        self.extra["samples"] = int(self.extra.get("samples", 0)) + len(ids)
        out = {k: float(v) for k, v in metrics.items()}
        out.setdefault("loss", float(loss.detach()))
        out.update(step_s=time.perf_counter() - t0, fetch_s=t_fetch,
                   samples=float(len(batch["ids"])),
                   trained_samples=float(self.extra["samples"]))
        return out

    def evaluate(self, eval_ids: dict[str, tuple[str, list[int]]],
                 inputs: dict[str, EncodedRefs]) -> dict[str, float]:
        """:meth:`evaluate_batch` on the evaluation inputs (all of them, on every rank)."""
        batch: dict[str, Any] = {}
        for modality, enc in inputs.items():
            split, ids = eval_ids[modality]
            batch[modality] = fetch_rows(enc, ids, 0, len(ids), self.mm.fetch_timeout_s)
            batch[f"{modality}_split"] = split
            batch[f"{modality}_ids"] = torch.tensor(list(ids), dtype=torch.int64)
        was_training = self.unwrapped.training
        self.unwrapped.eval()
        try:
            with torch.no_grad():
                out = self.evaluate_batch(batch)
        finally:
            self.unwrapped.train(was_training)
        return {k: float(v) for k, v in (out or {}).items()}

    # ------------------------------------------------------------------ internals
    def _fetch(self, ids: Sequence[int], inputs: dict[str, EncodedRefs]) -> dict[str, Any]:
        start, stop = chunk_bounds(len(ids), self.world_size)[self.rank]
        batch: dict[str, Any] = {"ids": torch.tensor(list(ids[start:stop]), dtype=torch.int64)}
        error: BaseException | None = None
        for modality, enc in inputs.items():
            try:
                batch[modality] = fetch_rows(enc, ids, start, stop, self.mm.fetch_timeout_s)
            except Exception as exc:  # noqa: BLE001 - agreed on below, then raised
                error = exc
                break
        failed = error is not None
        if self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                # on the backend's device: NCCL reduces only CUDA tensors
                ok = torch.tensor([0 if failed else 1], dtype=torch.int64,
                                  device=self.backend.device)
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
                failed = int(ok) == 0
        if failed:
            what = f"{type(error).__name__}: {error}" if error is not None else \
                "another trainer rank could not fetch its inputs"
            raise UpstreamLost(f"trainer-{self.rank}: an encoder's output of this step is "
                               f"lost ({what[:300]}); no rank trained on it")
        return batch


__all__ = ["FusionTrainerWorkload", "UpstreamLost"]
