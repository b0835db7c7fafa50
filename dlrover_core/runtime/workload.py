"""``BaseWorkload``: the user's code for one role instance."""

from __future__ import annotations

import contextvars
import inspect
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from omegaconf import DictConfig, OmegaConf

from dlrover_core.runtime.context import WorkerContext

if TYPE_CHECKING:
    from dlrover_core.checkpoint.checkpointer import Checkpointer
    from dlrover_core.runtime.backend import BackendSession
    from dlrover_core.runtime.role_state import RoleState

log = logging.getLogger(__name__)

# The context of the instance being constructed in the guide's style
# ``__init__(self, master_handle, config)``, where no context is passed in.
_CONSTRUCTING: contextvars.ContextVar[WorkerContext | None] = contextvars.ContextVar(
    "dlrover_constructing_workload", default=None)


def unwrap_actor_class(cls: Any) -> Any:
    """The user's class behind ``@ray.remote`` (seed ``004`` decorates workloads
    that way); any other object is returned unchanged. dlrover creates the Ray
    actor itself, so the decorator's options (``num_cpus``...) are ignored: the
    role's ``resources`` in the job spec decide."""
    inner = getattr(cls, "__ray_actor_class__", None)
    return inner if isinstance(inner, type) else cls


def guide_style_init(cls: type, base: type, names: tuple[str, ...]) -> bool:
    """Whether ``cls.__init__`` takes the seed-``004`` arguments ``names``
    (e.g. ``master_handle, config``) instead of dlrover's single context."""
    init = cls.__init__
    if init is base.__init__:
        return False
    # required ones only: (self, context, extra=None) is context style
    params = [p for p in list(inspect.signature(init).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
              and p.default is p.empty]
    if len(params) == len(names):
        return True
    if len(params) <= 1:
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in inspect.signature(init).parameters.values()):
        return False
    raise TypeError(
        f"{cls.__module__}.{cls.__qualname__}.__init__ takes {len(params)} arguments; allowed: "
        f"(self, context) or (self, {', '.join(names)})")


def create_workload(cls: Any, context: WorkerContext,
                    master_lookup: Callable[[], Any] | None = None) -> BaseWorkload:
    """Instantiate the workload class ``cls`` (a ``BaseWorkload`` subclass, possibly
    decorated with ``@ray.remote``) for ``context``, in whichever constructor style
    it was written: ``__init__(self, context)`` or the guide's
    ``__init__(self, master_handle, config)`` (``master_lookup()`` gives the JobMaster
    handle then, or ``None`` outside a job).

    Raises:
        TypeError: ``cls`` is not a ``BaseWorkload`` subclass, or its ``__init__``
            takes other arguments.
    """
    cls = unwrap_actor_class(cls)
    if not (isinstance(cls, type) and issubclass(cls, BaseWorkload)):
        raise TypeError(f"workload {cls!r} of role {context.role!r} is not a subclass of "
                        "dlrover_core.BaseWorkload")
    if not guide_style_init(cls, BaseWorkload, ("master_handle", "config")):
        return cls(context)
    token = _CONSTRUCTING.set(context)
    try:
        master = master_lookup() if master_lookup is not None else None
        return cls(master, OmegaConf.create(context.config or {}))
    finally:
        _CONSTRUCTING.reset(token)


class BaseWorkload:
    """Base class of every role's workload. One instance per role rank, in its own
    Ray actor process.

    Lifecycle (called by dlrover, in the worker process):

    1. ``__init__(context)``, or the guide's ``__init__(master_handle, config)``
       (seed ``004``; ``super().__init__(master_handle, config)``): store things
       only; do no heavy work.
    2. the backend joins the role's process group (``self.backend``), then
       :meth:`setup` runs: build the model, load data, restore a checkpoint.
    3. SPMD roles without a driver: :meth:`run` is the training loop; returning
       ends this instance successfully. Roles driven by a trainer: the driver calls
       the workload's methods through ``RG_<ROLE>`` role groups.

    Inside, :meth:`report` sends step metrics to the JobMaster, and
    :attr:`checkpointer` saves and loads state through the job's saver.
    """

    def __init__(self, context: Any = None, config: Any = None) -> None:
        master = None
        if not isinstance(context, WorkerContext):  # the guide's (master_handle, config)
            master, context = context, _CONSTRUCTING.get()
            if context is None:
                raise TypeError(
                    f"{type(self).__name__}(master_handle, config) is created by dlrover inside "
                    "its role's actor; to build one in a test use dlrover_core.testing.spawn_role")
        self._context = context
        self._config = OmegaConf.create(config if config is not None else (context.config or {}))
        self._backend: BackendSession | None = None
        self._checkpointer: Checkpointer | None = None
        self._master: Any = master
        self._last_step = -1
        self._last_metrics: dict[str, float] = {}
        self._started_at = time.time()

    # ------------------------------------------------------------------ identity
    @property
    def context(self) -> WorkerContext:
        return self._context

    @property
    def config(self) -> DictConfig:
        """The job's ``config`` merged with this role's ``config``."""
        return self._config

    @property
    def name(self) -> str:
        return self._context.name

    @property
    def role(self) -> str:
        return self._context.role

    @property
    def rank(self) -> int:
        return self._context.rank

    @property
    def world_size(self) -> int:
        return self._context.world_size

    @property
    def word_size(self) -> int:
        """``world_size`` under the spelling of seed ``004``'s property table."""
        return self._context.world_size

    @property
    def local_rank(self) -> int:
        return self._context.local_rank

    @property
    def local_world_size(self) -> int:
        return self._context.local_world_size

    @property
    def torch_master_addr(self) -> str:
        return self._context.master_addr

    @property
    def torch_master_port(self) -> int:
        return self._context.master_port

    @property
    def job_dir(self) -> str:
        return self._context.job_dir

    @property
    def attempt(self) -> int:
        """Restarts of this instance so far (0 on the first start)."""
        return self._context.attempt

    @property
    def backend(self) -> BackendSession:
        """The backend session (process group, ``wrap(model)``, ``device``).

        Raises:
            RuntimeError: the role has no ``backend`` in the job spec.
        """
        if self._backend is None:
            raise RuntimeError(
                f"role {self.role!r} has no backend; set roles.{self.role}.backend (e.g. fsdp)")
        return self._backend

    @property
    def master_handle(self) -> Any:
        """The JobMaster actor handle."""
        if self._master is None:
            import ray

            from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

            self._master = ray.get_actor(master_actor_name(self._context.job),
                                         namespace=MASTER_NAMESPACE)
        return self._master

    def _master_or_none(self) -> Any:
        """The master handle, or ``None`` outside a job (``dlrover_core.testing.spawn_role``)."""
        if self._master is None:
            try:
                return self.master_handle
            except ValueError:
                return None
        return self._master

    def is_actor_role(self) -> bool:
        return self.role == "actor"

    def get_device_collocation(self) -> str:
        """Roles sharing this instance's devices, comma separated upper-case
        (``"ACTOR,ROLLOUT"``), or ``""``."""
        return self._context.collocation.upper()

    # ------------------------------------------------------------------ user API
    @classmethod
    def warm_up(cls) -> None:
        """Pay one-off process costs (imports, first use of the optimizer or kernels)
        ahead of time, in a standby process that may later replace a failed rank
        (``failover.standby``). No ``self``: the rank is not known yet. Optional."""

    def setup(self) -> None:
        """Build the model, data and optimizer; restore a checkpoint. Override."""

    def run(self) -> Any:
        """The training loop of an SPMD role without a driver. Override."""
        raise NotImplementedError(
            f"{type(self).__name__}.run() is not implemented: role {self.role!r} has no driver,"
            " so its workload must implement run()")

    @property
    def checkpointer(self) -> Checkpointer:
        """Saves and loads state through the job's saver (``checkpoint.saver``)."""
        if self._checkpointer is None:
            from dlrover_core.checkpoint.checkpointer import Checkpointer

            self._checkpointer = Checkpointer.for_worker(self._context, self)
        return self._checkpointer

    # ------------------------------------------------------------------ state at commits
    def state_objects(self) -> dict[str, Any] | None:
        """What this role checkpoints at its driver's commit, as ``Checkpointer.save``
        objects (``{"model": module, "optimizer": opt, "rng": TorchRNG()}``), or
        ``None``. Default ``None``: the role is stateless, unless the workload has a
        ``state_dict()`` / ``load_state_dict(state)`` pair, which is then saved whole
        (:func:`dlrover_core.runtime.role_state.declared_objects`; docs/failover.md,
        "Stateful roles"). Override."""
        return None

    @property
    def role_state(self) -> RoleState:
        """This rank's :class:`~dlrover_core.runtime.role_state.RoleState` (its declared
        state, saved and restored with the job's saver)."""
        rs = self.__dict__.get("_role_state")
        if rs is None:
            from dlrover_core.runtime.role_state import RoleState

            rs = self._role_state = RoleState(self)
        return rs

    def has_state(self) -> bool:
        """Whether this role declares state (asked by the driver on rank 0).

        Raises:
            SpecError: ``roles.<role>.config.stateful`` is not a bool, or is true on a
                role that declares none.
        """
        return self.role_state.objects() is not None

    def save_state(self, step: int) -> int | None:
        """Checkpoint the declared state as ``step`` (the driver's commit) and wait for
        the saver's commit. Returns ``step``, or ``None`` for a stateless role."""
        return self.role_state.save(step)

    def restore_state(self, step: int) -> int | None:
        """Put this rank back to the driver's committed ``step`` (0: ``teardown()`` then
        ``setup()``). Returns ``step`` (``None`` for a stateless role).

        Raises:
            StateNotFound: the saver has no step ``step`` (never another step).
            CheckpointLoadError: the step exists but does not load.
        """
        return self.role_state.restore(step)

    def report(self, step: int, **metrics: float) -> None:
        """Report that ``step`` finished, with scalar metrics (``loss``, ``val_loss``,
        ``samples_per_s``...). Non-blocking. Rank 0 sends every report to the JobMaster
        at once; the other ranks' reports are coalesced to one message per
        ``dlrover_core.runtime.reporting.report_interval_s`` (their newest step still
        arrives, within that interval).

        Raises:
            TypeError: a metric is not a number.
        """
        clean = {}
        for k, v in metrics.items():
            try:
                clean[k] = float(v)
            except (TypeError, ValueError):
                raise TypeError(f"report({k}={v!r}): metrics must be numbers") from None
        self._last_step, self._last_metrics = int(step), clean
        reporter = self._step_reporter()
        if reporter is not None:  # lost while the master restarts: it asks for progress()
            reporter.report(int(step), clean, time.time())

    def _step_reporter(self) -> Any:
        """This rank's ``StepReporter`` (made at the first report), or ``None`` outside
        a job."""
        reporter = getattr(self, "_reporter", None)
        if reporter is None:
            master = self._master_or_none()
            if master is None:
                return None
            from dlrover_core.runtime.node_reporter import node_relay
            from dlrover_core.runtime.reporting import StepReporter, report_interval_s

            role, rank, c = self.role, self.rank, self._context
            interval = report_interval_s(self.world_size, c.hang_timeout_s)
            reporter = self._reporter = StepReporter(
                lambda step, m, ts: master.report.remote(role, rank, step, m, ts), rank,
                interval, node_relay(c.job, role, rank, self.world_size,
                                     c.local_world_size, interval,
                                     getattr(self, "_identity", None), c.hang_timeout_s))
        return reporter

    def teardown(self) -> None:
        """Release what :meth:`setup` acquired. Override if needed."""
