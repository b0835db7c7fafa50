"""The parallelism switches of seed 001's "DynamicParallelism", applied at a step
boundary: FSDP2 resharding and activation checkpointing.

- ``reshard_after_forward``: FSDP2 (``torch.distributed.fsdp.fully_shard``) lets it be
  changed between steps with ``FSDPModule.set_reshard_after_forward`` on every FSDP2
  module of the model. ``True`` frees the all-gathered parameters after forward (less
  memory, one more all-gather in backward); ``False`` keeps them until backward.
- ``activation_checkpointing``: :class:`ActivationCheckpointing` wraps the ``forward``
  of chosen blocks (e.g. the transformer blocks) once; while it is on, each block runs
  under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and its activations
  are recomputed in backward instead of kept. It must only change between steps
  (never between a forward and its backward).
"""

from __future__ import annotations

from typing import Any, Iterable

from dlrover_core.tuning.config import ParallelismSettings


class ActivationCheckpointing:
    """An on/off switch for activation checkpointing of ``blocks``.

    Args:
        blocks: the modules to checkpoint (each as a whole), e.g.
            ``[m for m in model.modules() if isinstance(m, Block)]``.
        enabled: the initial state.
    Raises:
        ValueError: ``blocks`` is empty.
    """

    def __init__(self, blocks: Iterable[Any], enabled: bool = False) -> None:
        self.blocks = list(blocks)
        if not self.blocks:
            raise ValueError("activation checkpointing needs at least one block")
        self.enabled = enabled
        self.recomputed = 0  # forward passes that ran checkpointed (for tests and logs)
        for block in self.blocks:
            self._wrap(block)

    def _wrap(self, block: Any) -> None:
        original = block.forward
        switch = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            import torch
            from torch.utils.checkpoint import checkpoint

            if switch.enabled and torch.is_grad_enabled():
                switch.recomputed += 1
                return checkpoint(original, *args, use_reentrant=False, **kwargs)
            return original(*args, **kwargs)

        block.forward = forward

    def set(self, enabled: bool) -> bool:
        """Turn it on or off; returns whether the state changed."""
        changed = bool(enabled) != self.enabled
        self.enabled = bool(enabled)
        return changed


def fsdp_modules(model: Any) -> list:
    """The FSDP2 modules in ``model`` (itself included), outermost first."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def apply_parallelism(settings: ParallelismSettings, model: Any = None,
                      activation_checkpointing: ActivationCheckpointing | None = None) -> dict:
    """Apply ``settings`` at a step boundary; ``None`` fields are left alone.

    Returns:
        what changed, e.g. ``{"reshard_after_forward": True}``.
    Raises:
        ValueError: ``reshard_after_forward`` is set but ``model`` has no FSDP2 module,
            or ``activation_checkpointing`` is set but no switch was given.
    """
    changed: dict = {}
    if settings.reshard_after_forward is not None:
        mods = fsdp_modules(model) if model is not None else []
        if not mods:
            raise ValueError("parallelism.reshard_after_forward needs an FSDP2 model "
                             "(torch.distributed.fsdp.fully_shard); this model has none")
        current = getattr(model, "_dlrover_reshard_after_forward", None)
        if current != settings.reshard_after_forward:
            for m in mods:
                m.set_reshard_after_forward(settings.reshard_after_forward, recurse=False)
            model._dlrover_reshard_after_forward = settings.reshard_after_forward
            changed["reshard_after_forward"] = settings.reshard_after_forward
    if settings.activation_checkpointing is not None:
        if activation_checkpointing is None:
            raise ValueError("parallelism.activation_checkpointing needs the workload to "
                             "register its blocks (TuningSession.attach(blocks=...))")
        if activation_checkpointing.set(settings.activation_checkpointing):
            changed["activation_checkpointing"] = settings.activation_checkpointing
    return changed
