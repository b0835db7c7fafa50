"""``BaseTrainer``: the driver of an MPMD job (PPO, online learning, multimodal)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dlrover_core.runtime.role_group import RoleGroup


@dataclass
class TrainerContext:
    """What the driver gets: ``role_groups`` (role -> RoleGroup), the job ``config``,
    per-role ``resources`` (``{"cpu": 1.0, "gpu": 0.0}``), ``job``, ``job_dir``."""

    job: str
    role_groups: dict[str, RoleGroup]
    config: Any = field(default_factory=dict)
    resources: dict[str, dict] = field(default_factory=dict)
    job_dir: str = ""
    attempt: int = 0


class BaseTrainer:
    """Drives the roles of an MPMD job. ``RG_<ROLE>`` attributes are the role groups
    (``actor`` -> ``RG_ACTOR``, ``udf_1`` -> ``RG_UDF_1``).

    Do no work in ``__init__``: :meth:`init` prepares (tokenizer, data), :meth:`fit`
    runs the loop; the job succeeds when ``fit`` returns.
    """

    def __init__(self, context: TrainerContext) -> None:
        self._context = context
        self._config = OmegaConf.create(context.config or {})
        self._last_step = -1
        self._master: Any = None
        for role, group in context.role_groups.items():
            setattr(self, f"RG_{role.upper()}", group)

    @property
    def config(self) -> DictConfig:
        return self._config

    @property
    def actor_handles(self) -> dict[str, list]:
        """role -> actor handles in rank order."""
        return {r: list(g.handles) for r, g in self._context.role_groups.items()}

    @property
    def job_dir(self) -> str:
        return self._context.job_dir

    def get_role_groups(self) -> list[str]:
        return sorted(self._context.role_groups)

    def get_workload_resource(self, role: str) -> dict:
        """Resources of one instance of ``role``: ``{"cpu": float, "gpu": float}``."""
        return dict(self._context.resources[role])

    def init(self) -> None:
        """Prepare before training. Override."""

    def fit(self) -> Any:
        """The main loop. Override."""
        raise NotImplementedError(f"{type(self).__name__}.fit() is not implemented")

    # ------------------------------------------------------------------ driver state
    @property
    def _state_path(self) -> str:
        import os

        return os.path.join(self._context.job_dir or ".", "driver", "state.pkl")

    def save_state(self, state: dict) -> None:
        """Persist the driver's own state (iteration, RNG, data position...) so that a
        restarted driver resumes (:meth:`load_state`). Atomic: temp file, fsync,
        rename; a sha256 of the payload is checked on load
        (:func:`dlrover_core.atomic_io.write_checksummed`). ``state`` must pickle."""
        import pickle

        from dlrover_core.atomic_io import write_checksummed

        write_checksummed(self._state_path, pickle.dumps(state))

    def load_state(self) -> dict | None:
        """The state last given to :meth:`save_state`, or ``None`` (first start, or a
        file whose checksum does not match: it is ignored with a warning)."""
        import logging
        import pickle

        from dlrover_core.atomic_io import read_checksummed

        try:
            payload = read_checksummed(self._state_path)
        except ValueError as exc:
            logging.getLogger(__name__).warning("driver state is corrupt; ignoring it: %s", exc)
            return None
        return None if payload is None else pickle.loads(payload)

    def report(self, step: int, **metrics: float) -> None:
        """Report a finished driver step with scalar metrics to the JobMaster."""
        import time

        import ray

        from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

        self._last_step = int(step)
        if self._master is None:
            self._master = ray.get_actor(master_actor_name(self._context.job),
                                         namespace=MASTER_NAMESPACE)
        self._master.report.remote("driver", 0, int(step),
                                   {k: float(v) for k, v in metrics.items()}, time.time())
