"""Job spec: schema, loader/validation, builder."""

from dlrover_core.spec.builder import DLJob, DLJobBuilder
from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.loader import load_spec
from dlrover_core.spec.schema import JobSpec, RoleSpec

__all__ = ["DLJob", "DLJobBuilder", "JobSpec", "RoleSpec", "SpecError", "load_spec"]
