"""Worker side: workloads, trainers (drivers), role groups, DRefs.

The names below load their submodule at first use (PEP 562 ``__getattr__``), so that a
light submodule (``runtime.reporting``, ``runtime.context``) does not pull Ray in with
the package: a script's first ``report_step`` imports ``runtime.reporting`` on its
training thread (importing this package eagerly took 0.55 s there, idle).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlrover_core.runtime.backend import BackendSession
    from dlrover_core.runtime.context import WorkerContext
    from dlrover_core.runtime.dref import DRef
    from dlrover_core.runtime.errors import InvocationTimeout, WorkloadError
    from dlrover_core.runtime.invocation import InvocationOptions, trainer_invocation
    from dlrover_core.runtime.role_group import RoleGroup
    from dlrover_core.runtime.trainer import BaseTrainer, TrainerContext
    from dlrover_core.runtime.workload import BaseWorkload

#: public name -> the submodule that defines it
_EXPORTS = {
    "BackendSession": "backend", "WorkerContext": "context", "DRef": "dref",
    "InvocationTimeout": "errors", "WorkloadError": "errors",
    "InvocationOptions": "invocation", "trainer_invocation": "invocation",
    "RoleGroup": "role_group", "BaseTrainer": "trainer", "TrainerContext": "trainer",
    "BaseWorkload": "workload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
