"""``DLJobBuilder``: build a job spec in Python (the API of DLRover's unified guide).

Example::

    job = (DLJobBuilder()
           .name("nanogpt").dl_type("SFT").node_num(1).device_per_node(2)
           .config({"max_steps": 300})
           .workload("trainer", "examples.nanogpt.workload", "GPTWorkload")
               .total(2).per_node(2).backend("fsdp")
           .build())
    result = job.submit()          # blocks; returns the summary dict
"""

from __future__ import annotations

import copy
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.schema import DL_TYPES


class RoleBuilder:
    """Workload-level settings of one role. Methods of the job builder are reachable
    from here too, so a chain can go on with ``.workload(...)``, ``.build()`` etc."""

    def __init__(self, parent: DLJobBuilder, role: dict) -> None:
        self._parent = parent
        self._role = role

    def total(self, n: int) -> RoleBuilder:
        self._role["total"] = n
        return self

    def per_node(self, n: int) -> RoleBuilder:
        self._role["per_node"] = n
        return self

    def env(self, env: dict[str, str]) -> RoleBuilder:
        self._role.setdefault("env", {}).update(env)
        return self

    def backend(self, name: str) -> RoleBuilder:
        self._role["backend"] = name
        return self

    def resource(self, cpu: float | None = None, gpu: float | None = None,
                 memory_mb: int | None = None) -> RoleBuilder:
        res = self._role.setdefault("resources", {})
        for k, v in (("cpu", cpu), ("gpu", gpu), ("memory_mb", memory_mb)):
            if v is not None:
                res[k] = v
        return self

    def config(self, config: dict) -> RoleBuilder:
        """Role-level config, merged over the job config for this role."""
        self._role["config"] = dict(config)
        return self

    def end(self) -> DLJobBuilder:
        return self._parent

    def __getattr__(self, item: str) -> Any:
        return getattr(self._parent, item)


class DLJobBuilder:
    """Fluent builder of a job spec; :meth:`build` validates it."""

    def __init__(self) -> None:
        self._spec: dict[str, Any] = {"roles": {}, "collocation": []}
        self._collocate_all = False

    # job level
    def name(self, name: str) -> DLJobBuilder:
        self._spec["name"] = name
        return self

    def dl_type(self, dl_type: str) -> DLJobBuilder:
        """``PRE``, ``SFT``, ``RL``, ``MULTIMODAL`` or ``ODL``; selects the default
        template (``sft``, ``ppo``, ``multimodal``, ``odl``)."""
        if dl_type.upper() not in DL_TYPES:
            raise SpecError("dl_type", dl_type, ", ".join(DL_TYPES))
        self._spec["dl_type"] = dl_type.upper()
        return self

    def template(self, name: str) -> DLJobBuilder:
        self._spec["template"] = name
        return self

    def node_num(self, n: int) -> DLJobBuilder:
        if n < 1:
            raise SpecError("node_num", n, "an integer >= 1")
        self._spec["node_num"] = n
        return self

    def device_per_node(self, n: int) -> DLJobBuilder:
        if n < 0:
            raise SpecError("device_per_node", n, "an integer >= 0")
        self._spec["device_per_node"] = n
        return self

    def config(self, config: dict | DictConfig) -> DLJobBuilder:
        if OmegaConf.is_config(config):
            config = OmegaConf.to_container(config, resolve=True)
        self._spec["config"] = copy.deepcopy(config)
        return self

    def global_env(self, env: dict[str, str]) -> DLJobBuilder:
        self._spec.setdefault("env", {}).update(env)
        return self

    def placement(self, policy: str) -> DLJobBuilder:
        self._spec["placement"] = policy
        return self

    def checkpoint(self, **kwargs: Any) -> DLJobBuilder:
        """``saver``, ``dir``, ``every_steps``, ``keep``."""
        self._spec.setdefault("checkpoint", {}).update(kwargs)
        return self

    def failover(self, **kwargs: Any) -> DLJobBuilder:
        """``max_restarts``, ``max_node_failures``, ``hang_timeout_s``, ``pg_timeout_s``."""
        self._spec.setdefault("failover", {}).update(kwargs)
        return self

    def edge(self, src: str, dst: str) -> DLJobBuilder:
        self._spec.setdefault("edges", []).append([src, dst])
        return self

    def trainer(self, module_name: str, class_name: str) -> DLJobBuilder:
        """The driver (``BaseTrainer`` subclass) of an MPMD job."""
        self._spec["driver"] = f"{module_name}:{class_name}"
        return self

    def workload(self, role: str, module_name: str, class_name: str) -> RoleBuilder:
        """Add (or reopen) role ``role`` running ``module_name:class_name``."""
        spec_role = self._spec["roles"].setdefault(role, {})
        spec_role["workload"] = f"{module_name}:{class_name}"
        return RoleBuilder(self, spec_role)

    def role(self, role: str) -> RoleBuilder:
        """Reopen an existing role's settings."""
        if role not in self._spec["roles"]:
            raise SpecError(f"roles.{role}", role, ", ".join(self._spec["roles"]) or "none yet",
                            "call .workload(role, module, class) first")
        return RoleBuilder(self, self._spec["roles"][role])

    def with_collocation(self, *roles: str) -> DLJobBuilder:
        self._spec["collocation"].append(list(roles))
        return self

    def with_collocation_all(self) -> DLJobBuilder:
        self._collocate_all = True
        return self

    def to_dict(self) -> dict:
        spec = copy.deepcopy(self._spec)
        if self._collocate_all:
            spec["collocation"] = [list(spec["roles"])]
        return spec

    def build(self, overrides: list[str] = ()) -> DLJob:  # type: ignore[assignment]
        """Validate and return the job. Raises :class:`SpecError`."""
        from dlrover_core.spec.loader import load_spec

        spec = self.to_dict()
        if "template" not in spec and "driver" not in spec:
            spec["template"] = DL_TYPES[spec.get("dl_type", "SFT")]
        return DLJob(load_spec(spec, overrides))


class DLJob:
    """A validated job, ready to submit."""

    def __init__(self, spec: DictConfig) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    def submit(self, address: str | None = None, job_dir: str | None = None,
               progress: bool = False) -> dict:
        """Run the job and block until it ends; returns the summary (``summary.json``)."""
        from dlrover_core.master.client import submit_job

        return submit_job(self.spec, address=address, job_dir=job_dir, progress=progress)
