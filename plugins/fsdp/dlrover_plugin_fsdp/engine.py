"""The ``dcp`` state-dict engine: model and optimizer state through
``torch.distributed.checkpoint.state_dict`` (sharded ``DTensor`` state for FSDP2,
plain tensors for DDP), so savers write each rank's shards and load them in place."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dlrover_core.checkpoint.engine import StateDictEngineBase


def _split(objects: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    model = objects.get("model")
    optim = objects.get("optimizer")
    rest = {k: v for k, v in objects.items() if k not in ("model", "optimizer")}
    return model, optim, rest


class DCPEngine(StateDictEngineBase):
    """``objects``: ``model`` (nn.Module, DDP or FSDP2), optional ``optimizer``, and any
    other entries (dicts of step, RNG, data position), handled like the plain engine."""

    def state_dict(self, objects: dict[str, Any]) -> dict:
        model, optim, rest = _split(objects)
        out = super().state_dict(rest)
        if isinstance(model, torch.nn.Module):
            msd, osd = get_state_dict(model, optim if optim is not None else [])
            out["model"] = msd
            if optim is not None:
                out["optimizer"] = osd
        return out

    def load_state_dict(self, objects: dict[str, Any], state_dict: dict) -> None:
        model, optim, rest = _split(objects)
        super().load_state_dict(rest, state_dict)
        if isinstance(model, torch.nn.Module):
            set_state_dict(model, optim if optim is not None else [],
                           model_state_dict=state_dict["model"],
                           optim_state_dict=state_dict.get("optimizer", {}))
