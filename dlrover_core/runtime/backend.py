"""The worker-side half of an SPMD backend."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlrover_core.runtime.context import WorkerContext


class BackendSession:
    """Sets up a role's process group in one worker and wraps its models.

    Backends subclass it (``dlrover_plugin_fsdp.backend:FSDPSession``) and name the
    subclass in their ``Backend`` record. Constructed in the worker process after
    ``MASTER_ADDR``/``MASTER_PORT`` are set.
    """

    def __init__(self, context: WorkerContext) -> None:
        self.context = context

    @property
    def device(self) -> Any:
        """The ``torch.device`` this rank computes on."""
        import torch

        return torch.device("cpu")

    def setup(self) -> None:
        """Join the role's process group. Called once per (re)start."""

    def wrap(self, model: Any, **kwargs: Any) -> Any:
        """Return the model ready for data-parallel training (default: unchanged)."""
        return model

    def teardown(self) -> None:
        """Leave the process group. Must not raise when the group is broken."""
