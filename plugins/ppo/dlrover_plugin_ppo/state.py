"""The state of an RL role as checkpointable objects (each with ``state_dict`` /
``load_state_dict``), saved with the job's saver at the driver's iteration boundary
(:meth:`dlrover_plugin_ppo.workloads.RLWorkload.save_state`): the torch random generator
(:class:`TorchRNG`), an optimizer keyed by parameter names (:class:`OptimizerState`),
small Python objects pickled (:class:`PickledState`); and the host copies of a model's
weights handed to other roles (:func:`cpu_state_dict`)."""

from __future__ import annotations

import pickle
from typing import Any

import torch

# the RNG and optimizer objects and the missing-step error are the core's (one mechanism for every
# template's stateful roles); re-exported here
from dlrover_core.runtime.role_state import (  # noqa: F401
    OptimizerState,
    StateNotFound,
    TorchRNG,
)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (or the model itself)."""
    return getattr(model, "module", model)


def cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers on the CPU, detached (what goes through the
    object store to other roles): tensors on a device are copied to the host; tensors
    already on the CPU are the model's own (no copy: returning them from a Ray call
    serializes them once into the object store, which is the copy the receivers read)."""
    return {k: v.detach().to("cpu") for k, v in unwrap(model).state_dict().items()}


class PickledState:
    """Attributes of an object (``names``) checkpointed as one pickled ``bytes`` value
    (environments, episode counters: small Python objects without ``state_dict``)."""

    def __init__(self, owner: Any, names: list[str]) -> None:
        self.owner, self.names = owner, list(names)

    def state_dict(self) -> dict[str, bytes]:
        return {"pickle": pickle.dumps({n: getattr(self.owner, n) for n in self.names})}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        for n, v in pickle.loads(state["pickle"]).items():
            setattr(self.owner, n, v)
