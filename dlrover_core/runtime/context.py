"""What a role instance knows about itself and its job (picklable, sent to the actor)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MASTER_NAMESPACE = "dlrover"


def master_actor_name(job: str) -> str:
    """Name of the JobMaster actor of ``job`` in namespace ``dlrover``."""
    return f"dlrover-master-{job}"


@dataclass
class WorkerContext:
    """Identity and settings of one role instance.

    Attributes:
        job, role: names; ``rank`` in ``[0, world_size)`` within the role;
        local_rank / local_world_size: position among the role's instances on the
            same node; ``node_rank``: which of the role's nodes (``rank // per_node``).
        backend: backend name or ``None``; ``collocation``: the roles sharing this
            instance's bundle (``"actor,rollout"``) or ``""``.
        config: the job config merged with the role config (plain containers).
        checkpoint / failover / tuning / observability: those sections of the job spec
            (dicts).
        job_dir: absolute path of the job directory.
        attempt: how many times this instance was restarted (0 at first start).
        gpu_ids: the GPU ids Ray reserved for this instance (strings; ``[]``: none);
            ``cuda_device``: the CUDA device index it computes on in its own process
            (``None``: the CPU). Set by the worker at ``setup()`` from Ray's
            assignment (:mod:`dlrover_core.runtime.devices`).
        run_id: identifies this run of the job (the JobMaster's actor id, hex; the same
            after a master restart, new for every submission).
        global_batch / micro_batch: the job's ``elastic.global_batch`` and
            ``elastic.micro_batch`` (samples per optimizer step over all ranks, and per
            forward/backward on one rank; 0: not set); ``grad_accum_steps`` follows from
            them and ``world_size`` (so it changes when a resize changes the world size).
    """

    job: str
    role: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int = 0
    backend: str | None = None
    collocation: str = ""
    config: Any = field(default_factory=dict)
    checkpoint: dict = field(default_factory=dict)
    failover: dict = field(default_factory=dict)
    tuning: dict = field(default_factory=dict)
    observability: dict = field(default_factory=dict)
    job_dir: str = ""
    attempt: int = 0
    master_addr: str = ""
    master_port: int = 0
    run_id: str = ""
    gpu_ids: list = field(default_factory=list)
    cuda_device: int | None = None
    global_batch: int = 0
    micro_batch: int = 0

    def __post_init__(self) -> None:
        self.grad_accum_steps  # noqa: B018 - a bad combination fails where it is made

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank: ``global_batch / (world_size x
        micro_batch)`` (0 when ``global_batch`` is not set).

        Raises:
            ValueError: ``global_batch`` is not a multiple of ``world_size x
                micro_batch`` (the message names ``elastic.global_batch``,
                ``elastic.micro_batch`` and the role's world size, with their values).
        """
        if not self.global_batch:
            return 0
        per_step = self.micro_batch * self.world_size
        if self.micro_batch < 1 or self.global_batch % per_step:
            raise ValueError(
                f"elastic.global_batch={self.global_batch} is not a multiple of "
                f"elastic.micro_batch={self.micro_batch} x world_size={self.world_size} of "
                f"role {self.role!r}; allowed: a global batch that splits into whole "
                "micro-batches on every rank")
        return self.global_batch // per_step

    @property
    def name(self) -> str:
        """Unique instance name ``<role>-<rank>``."""
        return f"{self.role}-{self.rank}"

    def env(self) -> dict[str, str]:
        """The torchrun-style environment of this instance."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "ROLE_NAME": self.role,
            "DLROVER_JOB": self.job,
            "DLROVER_ROLE": self.role,
            "DLROVER_ATTEMPT": str(self.attempt),
            **({"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
               if self.master_addr else {}),
            **({"DLROVER_GLOBAL_BATCH": str(self.global_batch),
                "DLROVER_MICRO_BATCH": str(self.micro_batch),
                "DLROVER_GRAD_ACCUM_STEPS": str(self.grad_accum_steps)}
               if self.global_batch else {}),
            # a script's step reports (dlrover_core.script_api) come at least this often
            **({"DLROVER_HANG_TIMEOUT_S": f"{self.hang_timeout_s:g}"}
               if self.hang_timeout_s > 0 else {}),
        }

    @property
    def hang_timeout_s(self) -> float:
        """``failover.hang_timeout_s`` of the job, in s (0: hang detection off)."""
        return float((self.failover or {}).get("hang_timeout_s") or 0.0)
