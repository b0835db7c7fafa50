"""dlrover-core: a pluggable control plane, on Ray, for distributed deep-learning jobs."""

from __future__ import annotations

__version__ = "0.1.0"

from dlrover_core.checkpoint.checkpointer import Checkpointer  # noqa: E402
from dlrover_core.plugins.hookspecs import hookimpl  # noqa: E402
from dlrover_core.plugins.records import (  # noqa: E402
    Backend,
    CheckpointSaver,
    Failure,
    FailureVerdict,
    GraphTemplate,
    PlacementPolicy,
    RoleTemplate,
    StateDictEngine,
    Tuner,
)
from dlrover_core.runtime import (  # noqa: E402
    BackendSession,
    BaseTrainer,
    BaseWorkload,
    DRef,
    RoleGroup,
    trainer_invocation,
)
from dlrover_core.spec.builder import DLJob, DLJobBuilder  # noqa: E402
from dlrover_core.spec.errors import SpecError  # noqa: E402
from dlrover_core.spec.loader import load_spec  # noqa: E402

__all__ = [
    "Backend", "BackendSession", "BaseTrainer", "BaseWorkload", "CheckpointSaver", "Checkpointer",
    "DLJob", "DLJobBuilder", "DRef", "Failure", "FailureVerdict", "GraphTemplate",
    "PlacementPolicy", "RoleGroup", "RoleTemplate", "SpecError", "StateDictEngine", "Tuner",
    "hookimpl", "load_spec", "trainer_invocation", "__version__",
]
