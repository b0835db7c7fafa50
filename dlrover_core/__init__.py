"""dlrover-core: a pluggable control plane, on Ray, for distributed deep-learning jobs.

The public names below are imported on first use (module ``__getattr__``, PEP 562),
so that ``from dlrover_core import hookimpl, Backend`` in a plugin's entry-point
module imports neither Ray nor torch; ``BaseWorkload``, ``RoleGroup`` and the like
bring Ray in when they are first touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlrover_core.lazy import lazy_getattr

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "hookimpl": "dlrover_core.plugins.hookspecs",
    "Backend": "dlrover_core.plugins.records",
    "CheckpointSaver": "dlrover_core.plugins.records",
    "Failure": "dlrover_core.plugins.records",
    "FailureKind": "dlrover_core.plugins.records",
    "FailoverLevel": "dlrover_core.plugins.records",
    "FailureVerdict": "dlrover_core.plugins.records",
    "GraphTemplate": "dlrover_core.plugins.records",
    "PlacementPolicy": "dlrover_core.plugins.records",
    "RoleTemplate": "dlrover_core.plugins.records",
    "StateDictEngine": "dlrover_core.plugins.records",
    "Tuner": "dlrover_core.plugins.records",
    "SpecError": "dlrover_core.spec.errors",
    "load_spec": "dlrover_core.spec.loader",
    "DLJob": "dlrover_core.spec.builder",
    "DLJobBuilder": "dlrover_core.spec.builder",
    "Checkpointer": "dlrover_core.checkpoint.checkpointer",
    "BackendSession": "dlrover_core.runtime.backend",
    "BaseTrainer": "dlrover_core.runtime.trainer",
    "BaseWorkload": "dlrover_core.runtime.workload",
    "DRef": "dlrover_core.runtime.dref",
    "RoleGroup": "dlrover_core.runtime.role_group",
    "trainer_invocation": "dlrover_core.runtime.invocation",
}

__all__ = ["Backend", "BackendSession", "BaseTrainer", "BaseWorkload", "CheckpointSaver",
    "Checkpointer", "DLJob", "DLJobBuilder", "DRef", "FailoverLevel", "Failure",
    "FailureKind", "FailureVerdict", "GraphTemplate", "PlacementPolicy", "RoleGroup",
    "RoleTemplate", "SpecError", "StateDictEngine", "Tuner", "hookimpl", "load_spec",
    "trainer_invocation", "__version__"]

if TYPE_CHECKING:
    from dlrover_core.checkpoint.checkpointer import Checkpointer
    from dlrover_core.plugins.hookspecs import hookimpl
    from dlrover_core.plugins.records import (
        Backend,
        CheckpointSaver,
        Failure,
        FailoverLevel,
        FailureKind,
        FailureVerdict,
        GraphTemplate,
        PlacementPolicy,
        RoleTemplate,
        StateDictEngine,
        Tuner,
    )
    from dlrover_core.runtime.backend import BackendSession
    from dlrover_core.runtime.dref import DRef
    from dlrover_core.runtime.invocation import trainer_invocation
    from dlrover_core.runtime.role_group import RoleGroup
    from dlrover_core.runtime.trainer import BaseTrainer
    from dlrover_core.runtime.workload import BaseWorkload
    from dlrover_core.spec.builder import DLJob, DLJobBuilder
    from dlrover_core.spec.errors import SpecError
    from dlrover_core.spec.loader import load_spec


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
