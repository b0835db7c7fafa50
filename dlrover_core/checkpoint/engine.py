"""State-dict engines: live objects <-> a state dict a saver can write."""

from __future__ import annotations

from typing import Any


class StateDictEngineBase:
    """Turns ``objects`` (``{"model": nn.Module, "optimizer": Optimizer, "extra": dict}``,
    any names) into one nested state dict and loads one back in place.

    Objects with ``state_dict()`` / ``load_state_dict()`` use them; dicts are copied
    (and updated in place on load); other values are stored as they are.
    """

    def state_dict(self, objects: dict[str, Any]) -> dict:
        out = {}
        for k, obj in objects.items():
            if hasattr(obj, "state_dict") and callable(obj.state_dict):
                out[k] = obj.state_dict()
            elif isinstance(obj, dict):
                out[k] = dict(obj)
            else:
                out[k] = obj
        return out

    def load_state_dict(self, objects: dict[str, Any], state_dict: dict) -> None:
        for k, obj in objects.items():
            if k not in state_dict:
                raise KeyError(f"checkpoint has no entry {k!r}; it has: {', '.join(state_dict)}")
            if hasattr(obj, "load_state_dict") and callable(obj.load_state_dict):
                obj.load_state_dict(state_dict[k])
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(state_dict[k])


class PlainEngine(StateDictEngineBase):
    """``state_dict()`` / ``load_state_dict()`` of each object (no sharding)."""
