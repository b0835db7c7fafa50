"""``DLJobBuilder``: build a job spec in Python (the API of DLRover's unified guide).

Example::

    job = (DLJobBuilder()
           .name("nanogpt").dl_type("SFT").node_num(1)
           .config({"max_steps": 300})
           .workload("trainer", "examples.nanogpt.workload", "GPTWorkload")
               .total(2).per_node(2).backend("fsdp")
           .build())
    rc = job.submit()              # blocks; the exit code (rc.summary: the summary)

``.device_per_node(n)`` declares ``n`` GPUs per node: each role instance then gets one
GPU unless its ``.resource(gpu=...)`` says otherwise. Without ``.name(...)`` the job
is named after its driver or first workload class (:meth:`DLJobBuilder.default_name`).
"""

from __future__ import annotations

import copy
import re
import uuid
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

    def enable_ray_auto_visible_device(self) -> RoleBuilder:
        """Let Ray assign this role's GPUs (its ``CUDA_VISIBLE_DEVICES``); by default
        every GPU of the node is visible and each instance uses the one Ray reserved for
        it (``cuda:<Ray's GPU id>``)."""
        self._role["enable_ray_auto_visible_device"] = True
        return self

    def config(self, config: dict) -> RoleBuilder:
        """Role-level config, merged over the job config for this role."""
        self._role["config"] = dict(config)
        return self

    def nproc_per_node(self, n: int) -> RoleBuilder:
        """torchrun's ``--nproc_per_node``: ``n`` ranks on each node (``per_node``);
        ``total`` becomes nodes x ``n``. Raises ``SpecError`` for ``n`` < 1."""
        if not isinstance(n, int) or n < 1:
            raise SpecError("nproc_per_node", n, "an integer >= 1")
        nodes = self._nodes()
        self._role["per_node"], self._role["total"] = n, nodes * n
        return self

    def nnodes(self, n: int) -> RoleBuilder:
        """torchrun's ``--nnodes``: the role spans ``n`` nodes (``total`` = ``n`` x
        ``per_node``). Raises ``SpecError`` for ``n`` < 1 (a ``MIN:MAX`` range is not
        supported yet)."""
        if not isinstance(n, int) or n < 1:
            raise SpecError("nnodes", n, "an integer >= 1 (elastic MIN:MAX is not built yet)")
        per = self._role.get("per_node") or self._role.get("total", 1)
        self._role["per_node"], self._role["total"] = per, n * per
        return self

    def _nodes(self) -> int:
        per = self._role.get("per_node") or self._role.get("total", 1)
        return max(1, self._role.get("total", 1) // per)

    def end(self) -> DLJobBuilder:
        return self._parent

    def __getattr__(self, item: str) -> Any:
        return getattr(self._parent, item)


#: ``checkpoint.every_steps`` of a built job whose builder did not set it (the spec's
#: own default, 0, saves only when the workload calls ``checkpointer.save``).
DEFAULT_EVERY_STEPS = 100


class DLJobBuilder:
    """Fluent builder of a job spec; :meth:`build` validates it. A built job saves a
    checkpoint every :data:`DEFAULT_EVERY_STEPS` steps (through ``maybe_save``) unless
    :meth:`checkpoint` sets ``every_steps``."""

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

    def device_type(self, kind: str) -> DLJobBuilder:
        """What :meth:`device_per_node` counts (upstream's name): ``"GPU"`` (the default;
        each instance gets one GPU, and a cluster without enough GPUs is refused before
        anything starts) or ``"CPU"`` (each instance holds its ``resources.cpu`` of the
        node's ``device_per_node`` CPUs and no GPU, so a program written for GPUs runs
        on a machine without them). Raises ``SpecError`` for another value."""
        if not isinstance(kind, str) or kind.upper() not in ("CPU", "GPU"):
            raise SpecError("device_type", kind, "CPU or GPU")
        self._spec["device_type"] = kind.upper()
        return self

    def config(self, config: dict | DictConfig) -> DLJobBuilder:
        if OmegaConf.is_config(config):
            config = OmegaConf.to_container(config, resolve=True)
        self._spec["config"] = copy.deepcopy(config)
        return self

    def global_env(self, env: dict[str, str]) -> DLJobBuilder:
        """Environment variables for every process of the job: each role's actors (and
        a script role's rank processes) and the driver; a role's ``.env`` overrides."""
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
        """``max_restarts``, ``master_max_restarts``, ``max_node_failures``,
        ``hang_timeout_s``, ``pg_timeout_s`` (``dlrover_core.spec.schema.FailoverSpec``)."""
        self._spec.setdefault("failover", {}).update(kwargs)
        return self

    def node_health(self, **kwargs: Any) -> DLJobBuilder:
        """The ``node_health`` section (``dlrover_core.spec.node_health.NodeHealthSpec``):
        ``skip_node_check``, ``slow_factor``, ``straggler_action``, ... ."""
        self._spec.setdefault("node_health", {}).update(kwargs)
        return self

    def skip_node_check(self, skip: bool = True) -> DLJobBuilder:
        """Turn the pre-flight node check off (``node_health.skip_node_check``)."""
        return self.node_health(skip_node_check=skip)

    def edge(self, src: str, dst: str) -> DLJobBuilder:
        self._spec.setdefault("edges", []).append([src, dst])
        return self

    def trainer(self, module_name: str, class_name: str) -> DLJobBuilder:
        """The driver (``BaseTrainer`` subclass) of an MPMD job."""
        self._spec["driver"] = f"{module_name}:{class_name}"
        return self

    def workload(self, *args: str) -> RoleBuilder:
        """Add (or reopen) a role running a ``BaseWorkload`` subclass.

        ``workload(role, module_name, class_name)`` names the role;
        ``workload(module_name, class_name)`` (seed ``004``'s job-level form) is the
        single SPMD role of a ``PRE``/``SFT`` job, named ``trainer``.

        Raises:
            SpecError: another number of arguments, or the two-argument form in a job
                whose ``dl_type`` has several roles.
        """
        if len(args) == 3:
            role, module_name, class_name = args
        elif len(args) == 2:
            dl_type = self._spec.get("dl_type", "SFT")
            if dl_type not in ("PRE", "SFT"):
                raise SpecError("workload", args, "workload(role, module, class) in a "
                                f"{dl_type} job", "the (module, class) form names the single "
                                "trainer role of a PRE/SFT job; name the role (e.g. "
                                ".actor(module, class) or .workload('actor', module, class))")
            role, (module_name, class_name) = "trainer", args
        else:
            raise SpecError("workload", args, "(module_name, class_name) or "
                            "(role, module_name, class_name)")
        spec_role = self._spec["roles"].setdefault(role, {})
        spec_role["workload"] = f"{module_name}:{class_name}"
        return RoleBuilder(self, spec_role)

    def train(self, command: str, role: str = "trainer") -> RoleBuilder:
        """A script role (upstream's unified API): an unchanged torchrun script run by
        every rank, e.g. ``.train("train.py --epochs 3").nnodes(1).nproc_per_node(2)``.
        ``command`` is ``"file.py args"``, ``"-m module args"`` or
        ``"module:function args"`` (see :mod:`dlrover_core.runtime.script`); it is
        checked by :meth:`build`."""
        spec_role = self._spec["roles"].setdefault(role, {})
        spec_role["command"] = command
        return RoleBuilder(self, spec_role)

    # the RL roles of seed 000 / 004, by name
    def actor(self, module_name: str, class_name: str) -> RoleBuilder:
        return self.workload("actor", module_name, class_name)

    def rollout(self, module_name: str, class_name: str) -> RoleBuilder:
        return self.workload("rollout", module_name, class_name)

    def reference(self, module_name: str, class_name: str) -> RoleBuilder:
        return self.workload("reference", module_name, class_name)

    def reward(self, module_name: str, class_name: str) -> RoleBuilder:
        return self.workload("reward", module_name, class_name)

    def critic(self, module_name: str, class_name: str) -> RoleBuilder:
        return self.workload("critic", module_name, class_name)

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

    def default_name(self) -> str:
        """A job name for a builder that set none (the guide never does): the driver's
        class name, else the first role's workload class, in lower case, plus 6 random
        hex digits so that two submissions never share a name (``usertrainer-3fa2c1``)."""
        source = self._spec.get("driver") or next(
            (r.get("workload") or _command_name(r.get("command"))
             for r in self._spec["roles"].values() if r.get("workload") or r.get("command")),
            "job")
        base = re.sub(r"[^a-z0-9_.-]+", "-", source.rpartition(":")[2].lower()).strip("-._")
        return f"{base or 'job'}-{uuid.uuid4().hex[:6]}"

    def build(self, overrides: list[str] = ()) -> DLJob:  # type: ignore[assignment]
        """Validate and return the job. Without :meth:`name`, the job gets
        :meth:`default_name` (new for every ``build``).

        Raises:
            SpecError: any invalid setting; for ``dl_type("RL")`` also a job without
                an ``actor`` role (seed ``004``: the actor is mandatory).
        """
        from dlrover_core.spec.loader import load_spec

        spec = self.to_dict()
        spec.setdefault("name", self.default_name())
        # checkpoints by default, as the example job files do (issue 29)
        spec["checkpoint"] = {"every_steps": DEFAULT_EVERY_STEPS,
                              **(spec.get("checkpoint") or {})}
        if "template" not in spec and "driver" not in spec:
            spec["template"] = DL_TYPES[spec.get("dl_type", "SFT")]
        return DLJob(load_spec(spec, overrides))


def _command_name(command: str | None) -> str:
    """``train`` for ``"path/train.py --x 1"``, ``main`` for ``"pkg.mod:main"``."""
    import os

    if not command:
        return ""
    words = command.split()
    if not words:
        return ""
    head = words[1] if words[0] in ("-m", "--module") and len(words) > 1 else words[0]
    if ":" in head and not head.endswith(".py"):
        return head.rpartition(":")[2]
    return os.path.splitext(os.path.basename(head))[0].replace(".", "-")


class DLJob:
    """A validated job, ready to submit."""

    def __init__(self, spec: DictConfig) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    def submit(self, address: str | None = None, job_dir: str | None = None,
               progress: bool = False, fresh: bool = False) -> SubmitResult:
        """Run the job (a new run in ``job_dir``) and block until it ends. It resumes
        from the job's checkpoints unless ``fresh`` (see
        :func:`dlrover_core.master.client.submit_job`).

        Returns the job's exit code, as DLRover's ``submit`` does: a
        :class:`SubmitResult`, an ``int`` (0 succeeded, 4 already complete, 1 anything
        else, the codes of ``dlrover submit``) whose ``summary`` is the run's summary
        (``summary.json``); ``result["status"]`` reads the summary too. A job that did
        not succeed prints ``job <name> <status>: <error>`` on stderr; nothing is
        raised for it."""
        import sys

        from dlrover_core.master.client import submit_job

        summary = submit_job(self.spec, address=address, job_dir=job_dir, progress=progress,
                             fresh=fresh) or {"status": "unknown",
                                              "error": "the job ended without a summary"}
        result = SubmitResult(summary)
        if summary.get("status") != "succeeded":
            print(f"job {self.name} {summary.get('status')}: "
                  f"{summary.get('error') or 'no error recorded'} (exit code {int(result)})",
                  file=sys.stderr, flush=True)
        return result


#: exit code of a job by its final status (anything else: 1); ``dlrover submit`` and
#: :meth:`DLJob.submit` both use it
EXIT_CODES = {"succeeded": 0, "already_complete": 4}


class SubmitResult(int):
    """The exit code of a submitted job (an ``int``) carrying its ``summary`` dict;
    ``result[key]`` and ``result.get(key)`` read the summary."""

    summary: dict

    def __new__(cls, summary: dict) -> SubmitResult:
        obj = super().__new__(cls, EXIT_CODES.get(summary.get("status"), 1))
        obj.summary = summary
        return obj

    def __reduce__(self) -> tuple:
        return SubmitResult, (self.summary,)

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.summary.get(key, default)

    def __repr__(self) -> str:
        return f"SubmitResult(exit_code={int(self)}, status={self.summary.get('status')!r})"
