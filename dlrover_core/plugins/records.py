"""Frozen records for the named things that plugins register.

Every record has a unique lower-case ``name``; the manager rejects clashes and
stamps each record with the plugin that provided it (``provider``). Records
that need heavy imports (torch, megatron, deepspeed) point at their
implementation by an import path ``"package.module:attr"`` that is resolved only
in the process that uses it, so a plugin's entry-point module stays light.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from dlrover_core.graph.graph import ComputationGraph

_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]*$")


class FailoverLevel(StrEnum):
    """How much the JobMaster restarts, from the smallest scope to the largest.

    A ``StrEnum``: members compare equal to their strings (``FailoverLevel.NODE ==
    "node"``) and are written as those strings to events, the job context and
    ``summary.json``.
    """

    PROCESS = "process"  # the failed instance (its role's process group is re-formed)
    ROLE = "role"        # every instance of the role
    NODE = "node"        # mark the node bad, re-place everything elsewhere
    JOB = "job"          # every role and the driver
    FATAL = "fatal"      # stop the job with the error


#: Failover levels, from the smallest scope to the largest. ``fatal`` stops the job.
FAILOVER_LEVELS = tuple(level.value for level in FailoverLevel)


class FailureKind(StrEnum):
    """What the JobMaster saw fail (``Failure.kind``); compares equal to its string."""

    ACTOR_DIED = "actor_died"              # the process or actor is gone
    USER_ERROR = "user_error"              # user code raised
    HANG = "hang"                          # no step report for failover.hang_timeout_s
    NODE_LOST = "node_lost"                # the instance's node left the cluster
    MASTER_RESTARTED = "master_restarted"  # found dead by a restarted master
    STRAGGLER = "straggler"                # alive but slower than its peers (replaced)


def check_name(kind: str, name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a valid lower-case record name."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"{kind} name {name!r} is invalid: use lower-case letters, digits, '_' or '-',"
            " starting with a letter"
        )


def resolve(path: str) -> Any:
    """Import ``"package.module:attr"`` (``attr`` may be dotted) and return the object.

    Raises:
        ImportError: the module cannot be imported.
        AttributeError: the module has no such attribute.
        ValueError: ``path`` has no ``:``.
    """
    if ":" not in path:
        raise ValueError(f"import path {path!r} must look like 'package.module:attr'")
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class _Record:
    name: str
    description: str = ""
    provider: str = ""  # filled in by the manager: the plugin that registered it

    def __post_init__(self) -> None:
        check_name(type(self).__name__, self.name)


@dataclass(frozen=True)
class RoleTemplate:
    """One role a graph template knows about.

    Attributes:
        name: role name in the job spec (``actor``, ``rollout``, ``trainer``), or, with
            ``pattern``, how the job names roles of this kind (``<modality>_encoder``).
        required: the template refuses a job without this role (not for a pattern).
        description: one line for ``dlrover templates list``.
        pattern: ``name`` stands for any number of roles the job names itself (one
            encoder per modality, say). A template with a pattern role lets a job have
            roles it does not list by name; its ``apply`` checks them.
    """

    name: str
    required: bool = True
    description: str = ""
    pattern: bool = False


@dataclass(frozen=True)
class GraphTemplate(_Record):
    """A graph template: fills in roles, edges and the driver of a job spec.

    Attributes:
        roles: the roles the template knows; required ones must be in the job.
        edges: default data-flow edges ``(src_role, dst_role)`` among those roles.
        driver: import path of the ``BaseTrainer`` subclass that drives the roles,
            or ``None`` for SPMD jobs whose workloads run their own loop.
        apply: optional ``(spec: DictConfig) -> None`` that fills template defaults
            into the spec in place before validation; it may raise ``SpecError``.
    """

    roles: tuple[RoleTemplate, ...] = ()
    edges: tuple[tuple[str, str], ...] = ()
    driver: str | None = None
    apply: Callable[[Any], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Backend(_Record):
    """An SPMD backend (``ddp``, ``fsdp``, ``megatron``, ``deepspeed``).

    Attributes:
        session: import path of a ``BackendSession`` subclass, constructed in the
            worker process with the ``WorkerContext``; it sets up the role's process
            group and wraps models.
        state_dict_engine: name of the ``StateDictEngine`` record its checkpoints use.
        validate_role: optional ``(role: str, role_spec: dict, config: dict) -> None``
            called when the spec is loaded, before anything starts, for every role
            that selects this backend; ``role_spec`` is ``roles.<role>`` and
            ``config`` the job's ``config`` merged with the role's (plain dicts). It
            raises ``SpecError`` (or ``ValueError``) naming the key, value and what is
            allowed (e.g. a tensor-parallel size that does not divide ``total``). It
            must import nothing heavy.
    """

    session: str = ""
    state_dict_engine: str = "dcp"
    validate_role: Callable[[str, dict, dict], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class StateDictEngine(_Record):
    """Turns a backend's live objects (model, optimizer, extra state) into a state
    dict a saver can write, and loads one back in place.

    Attributes:
        engine: import path of a ``dlrover_core.checkpoint.engine.StateDictEngineBase``
            subclass.
    """

    engine: str = ""


@dataclass(frozen=True)
class CheckpointSaver(_Record):
    """A checkpoint saver (``disk``, ``flash``).

    Attributes:
        saver: import path of a ``dlrover_core.checkpoint.saver.Saver`` subclass,
            constructed in the worker process as ``cls(config, context)``.
        validate_options: optional ``(options: dict) -> None`` that checks the job's
            ``checkpoint.options`` when the spec is loaded, before anything starts; it
            raises ``SpecError`` (or ``ValueError``) naming the key, value and what is
            allowed. It must import nothing heavy.
    """

    saver: str = ""
    validate_options: Callable[[dict], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PlacementPolicy(_Record):
    """A placement policy.

    Attributes:
        plan: ``(graph: ComputationGraph, cluster: ClusterResources) -> PlacementPlan``
            (see :mod:`dlrover_core.placement`); it raises ``PlacementError``
            when the graph cannot fit.
    """

    plan: Callable[[ComputationGraph, Any], Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Tuner(_Record):
    """A tuner: turns step metrics into a new ``TuningConfig`` version.

    Attributes:
        tuner: import path of a ``dlrover_core.tuning.tuner.TunerBase`` subclass.
    """

    tuner: str = ""


@dataclass(frozen=True)
class StreamSource(_Record):
    """A stream source for streaming jobs (the ``odl`` template's ``source`` role):
    an in-cluster replay, a broker such as Redis Streams.

    Attributes:
        source: import path of the source class, constructed in the ``source`` role's
            worker process; its interface is ``dlrover_plugin_odl.source.StreamSourceBase``
            (``seek``, ``read``, ``commit``, ``close``).
        validate_options: optional ``(options: dict) -> None`` that checks the job's
            ``config.odl.source.options`` when the spec is loaded; it raises ``SpecError``
            (or ``ValueError``) naming the key, value and what is allowed. It must import
            nothing heavy.
    """

    source: str = ""
    validate_options: Callable[[dict], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Failure:
    """What failed, as seen by the JobMaster. Build one with a named constructor
    (:meth:`user_error`, :meth:`actor_died`, :meth:`hang`, :meth:`node_lost`).

    Attributes:
        kind: a ``FailureKind`` (``actor_died``, ``user_error``, ``hang``,
            ``node_lost``, ``master_restarted``); a plain string is converted.
        role, rank: the role instance, when one is known.
        node_id: Ray node id of the instance, when known.
        exc_type: qualified name of the exception type (``builtins.ValueError``).
        message: the exception message or Ray's death cause.
        traceback: the formatted traceback from the worker ('' when none).
        phase: ``setup`` (before the first step) or ``run``.
        step: the last step the instance reported (-1 before the first).
        attempt: how many times this role instance was already restarted.

    Raises:
        ValueError: ``kind`` is not a ``FailureKind``.
    """

    kind: FailureKind
    role: str = ""
    rank: int = -1
    node_id: str = ""
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    phase: str = "run"
    step: int = -1
    attempt: int = 0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", FailureKind(self.kind))
        except ValueError:
            raise ValueError(
                f"Failure.kind {self.kind!r} is invalid; allowed: "
                f"{', '.join(k.value for k in FailureKind)}") from None

    @classmethod
    def user_error(cls, role: str, rank: int, exc_type: str, message: str, traceback: str = "",
                   *, node_id: str = "", phase: str = "run", step: int = -1,
                   attempt: int = 0) -> Failure:
        """User code raised ``exc_type: message`` (with the worker's ``traceback``)."""
        return cls(FailureKind.USER_ERROR, role, rank, node_id, exc_type, message, traceback,
                   phase, step, attempt)

    @classmethod
    def actor_died(cls, role: str, rank: int, message: str = "actor died", *,
                   exc_type: str = "ActorDiedError", node_id: str = "", phase: str = "run",
                   step: int = -1, attempt: int = 0) -> Failure:
        """The instance's actor or process is gone; ``message``: Ray's death cause."""
        return cls(FailureKind.ACTOR_DIED, role, rank, node_id, exc_type, message, "", phase,
                   step, attempt)

    @classmethod
    def hang(cls, role: str, rank: int, silent_s: float, timeout_s: float, *,
             node_id: str = "", step: int = -1, attempt: int = 0) -> Failure:
        """No step report for ``silent_s`` seconds, over ``failover.hang_timeout_s``."""
        return cls(FailureKind.HANG, role, rank, node_id, "Hang",
                   f"no step report for {silent_s:.1f} s (hang_timeout_s={timeout_s:g})", "",
                   "run", step, attempt)

    @classmethod
    def node_lost(cls, role: str, rank: int, node_id: str, detail: str = "", *,
                  phase: str = "run", step: int = -1, attempt: int = 0) -> Failure:
        """The node ``node_id`` of the instance left the Ray cluster."""
        message = f"node {node_id[:12]} left the Ray cluster" + (f": {detail}" if detail else "")
        return cls(FailureKind.NODE_LOST, role, rank, node_id, "NodeLost", message, "", phase,
                   step, attempt)

    def as_dict(self) -> dict:
        """JSON-friendly fields (enum values as strings)."""
        return {**vars(self), "kind": self.kind.value}


@dataclass(frozen=True)
class FailureVerdict:
    """A classifier's answer.

    Attributes:
        level: a ``FailoverLevel`` (a plain string is converted).
        reason: one sentence a user can act on.
        classifier: name of the plugin that answered (filled by the manager).

    Raises:
        ValueError: ``level`` is not one of ``FAILOVER_LEVELS``.
    """

    level: FailoverLevel
    reason: str
    classifier: str = ""

    def __post_init__(self) -> None:
        if self.level not in FAILOVER_LEVELS:
            raise ValueError(
                f"failover level {self.level!r} is not one of {', '.join(FAILOVER_LEVELS)}"
            )
        object.__setattr__(self, "level", FailoverLevel(self.level))
