"""Worker side: workloads, trainers (drivers), role groups, DRefs."""

from dlrover_core.runtime.backend import BackendSession
from dlrover_core.runtime.context import WorkerContext
from dlrover_core.runtime.dref import DRef
from dlrover_core.runtime.errors import InvocationTimeout, WorkloadError
from dlrover_core.runtime.invocation import InvocationOptions, trainer_invocation
from dlrover_core.runtime.role_group import RoleGroup
from dlrover_core.runtime.trainer import BaseTrainer, TrainerContext
from dlrover_core.runtime.workload import BaseWorkload

__all__ = [
    "BackendSession", "BaseTrainer", "BaseWorkload", "DRef", "InvocationOptions",
    "InvocationTimeout", "RoleGroup", "TrainerContext", "WorkerContext", "WorkloadError",
    "trainer_invocation",
]
