"""``BaseTrainer``: the driver of an MPMD job (PPO, online learning, multimodal)."""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from dlrover_core.runtime.role_group import RoleGroup, WorkloadActorHandle
from dlrover_core.runtime.workload import guide_style_init, unwrap_actor_class

if TYPE_CHECKING:
    from dlrover_core.runtime.role_state import RoleCommits

_CONSTRUCTING: contextvars.ContextVar[TrainerContext | None] = contextvars.ContextVar(
    "dlrover_constructing_trainer", default=None)


@dataclass
class TrainerContext:
    """What the driver gets: ``role_groups`` (role -> RoleGroup), the job ``config``,
    per-role ``resources`` (``{"cpu": 1.0, "gpu": 0.0}``), ``job``, ``job_dir``,
    ``workloads`` (role -> import path ``package.module:Class`` of its workload) and the
    job's ``observability`` section (a dict)."""

    job: str
    role_groups: dict[str, RoleGroup]
    config: Any = field(default_factory=dict)
    resources: dict[str, dict] = field(default_factory=dict)
    job_dir: str = ""
    attempt: int = 0
    workloads: dict[str, str] = field(default_factory=dict)
    observability: dict = field(default_factory=dict)


def create_trainer(cls: Any, context: TrainerContext) -> BaseTrainer:
    """Instantiate the driver class ``cls`` for ``context`` in whichever constructor
    style it was written: ``__init__(self, context)`` or the guide's
    ``__init__(self, actor_handles, actor_classes, config)`` (seed ``004``).

    Raises:
        TypeError: ``cls`` is not a ``BaseTrainer`` subclass, or its ``__init__``
            takes other arguments.
    """
    cls = unwrap_actor_class(cls)
    if not (isinstance(cls, type) and issubclass(cls, BaseTrainer)):
        raise TypeError(f"driver {cls!r} is not a subclass of dlrover_core.BaseTrainer")
    if not guide_style_init(cls, BaseTrainer, ("actor_handles", "actor_classes", "config")):
        return cls(context)
    token = _CONSTRUCTING.set(context)
    classes = _actor_classes(context)
    try:
        return cls(_actor_handles(context, classes), classes,
                   OmegaConf.create(context.config or {}))
    finally:
        _CONSTRUCTING.reset(token)


def _actor_classes(context: TrainerContext) -> dict[str, type]:
    from dlrover_core.plugins.records import resolve

    return {role: unwrap_actor_class(resolve(path)) for role, path in context.workloads.items()}


def _actor_handles(context: TrainerContext,
                   classes: dict[str, type]) -> dict[str, list[WorkloadActorHandle]]:
    return {role: [WorkloadActorHandle(h, role, rank, classes.get(role))
                   for rank, h in enumerate(group.handles)]
            for role, group in context.role_groups.items()}


class BaseTrainer:
    """Drives the roles of an MPMD job. ``RG_<ROLE>`` attributes are the role groups
    (``actor`` -> ``RG_ACTOR``, ``udf_1`` -> ``RG_UDF_1``).

    Do no work in ``__init__``: :meth:`init` prepares (tokenizer, data), :meth:`fit`
    runs the loop; the job succeeds when ``fit`` returns.

    Constructors: ``__init__(self, context)``, or the guide's
    ``__init__(self, actor_handles, actor_classes, config)`` (seed ``004``), which
    passes them on with ``super().__init__(actor_handles, actor_classes, config)``.
    """

    def __init__(self, context: Any = None, actor_classes: Any = None,
                 config: Any = None) -> None:
        if not isinstance(context, TrainerContext):  # the guide's three arguments
            context = _CONSTRUCTING.get()
            if context is None:
                raise TypeError(
                    f"{type(self).__name__}(actor_handles, actor_classes, config) is created by "
                    "dlrover in the job's driver actor")
        self._context = context
        self._config = OmegaConf.create(config if config is not None else (context.config or {}))
        self._last_step = -1
        self._master: Any = None
        self._last_report: Any = None  # ObjectRef of the newest master.report call
        for role, group in context.role_groups.items():
            setattr(self, f"RG_{role.upper()}", group)

    @property
    def config(self) -> DictConfig:
        return self._config

    @functools.cached_property
    def actor_handles(self) -> dict[str, list[WorkloadActorHandle]]:
        """role -> one handle per instance, in rank order. ``h.update.remote(x)``
        calls the workload's ``update(x)`` in that instance and returns Ray's
        ``ObjectRef`` (seed ``004``'s style); ``h.node_info.remote()``,
        ``h.ping.remote()`` and ``h.progress.remote()`` reach the hosting actor.
        Built once per driver (a restarted driver is a new trainer)."""
        return _actor_handles(self._context, self.actor_classes)

    @functools.cached_property
    def actor_classes(self) -> dict[str, type]:
        """role -> the workload class of that role (``@ray.remote`` unwrapped)."""
        return _actor_classes(self._context)

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

    # ------------------------------------------------------------------ commits
    @functools.cached_property
    def role_commits(self) -> RoleCommits:
        """The commits of this driver's stateful roles
        (:class:`~dlrover_core.runtime.role_state.RoleCommits`)."""
        from dlrover_core.runtime.role_state import RoleCommits

        return RoleCommits(self)

    def commit_roles(self, step: int, state: dict | None = None) -> None:
        """End of an iteration: every stateful role (one that declares state, see
        :mod:`dlrover_core.runtime.role_state`) saves ``step`` and waits for its saver's
        commit, then the driver's ``state`` is saved with ``committed_step: step``
        (:meth:`save_state`, atomic): that write is the commit. Report the iteration
        after this returns, so that no report is of work a restart throws away."""
        self.role_commits.commit(step, dict(state or {}))

    def resume_roles(self) -> dict | None:
        """Call first in :meth:`init`. The state of the last :meth:`commit_roles`
        (``None`` when there was none), after every stateful role was put back to its
        ``committed_step``: a restarted role (or one that ran ahead of the commit, the
        driver having died after its update) resumes exactly at the commit. With no
        commit yet, a restarted driver puts them back to step 0 (their ``setup()``);
        a first start touches nothing.

        Raises:
            StateNotFound: a role's saver lacks the committed step.
        """
        state = self.load_state()
        if state is not None and "committed_step" in state:
            self.role_commits.rollback(int(state["committed_step"]))
        elif self._context.attempt > 0:
            self.role_commits.rollback(0)
        return state

    @property
    def master_handle(self) -> Any:
        """The JobMaster actor handle of this driver's job (looked up once).

        Raises:
            ValueError: no JobMaster of this job is running (Ray's ``get_actor``).
        """
        if self._master is None:
            import ray

            from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

            self._master = ray.get_actor(master_actor_name(self._context.job),
                                         namespace=MASTER_NAMESPACE)
        return self._master

    def report(self, step: int, **metrics: float) -> None:
        """Report a finished driver step with scalar metrics to the JobMaster. The
        previous report is waited for first (at most 10 s): the master runs its calls
        on several threads, and a burst of reports (the steps of one commit) would
        otherwise reach ``metrics.jsonl`` out of step order."""
        import time

        import ray

        self._last_step = int(step)
        if self._last_report is not None:
            ray.wait([self._last_report], timeout=10)
        self._last_report = self.master_handle.report.remote(
            "driver", 0, int(step), {k: float(v) for k, v in metrics.items()}, time.time())
