"""Entry point of the ``odl`` plugin: the ``odl`` graph template and the stream
sources ``replay`` (embedded, in-cluster) and ``redis`` (Redis Streams).

Imports nothing heavy (no torch, no redis-py): the driver, workloads and sources
are named by import path and loaded only in the processes that run them.

``odl``: ``source`` -> ``preprocess`` -> ``trainer``, with an optional ``eval``.
The template fills in ``source`` (the built-in :class:`SourceWorkload`) and
``preprocess`` (the default :class:`PreprocessWorkload`) when the job leaves them
out; ``trainer`` is required. The driver :class:`dlrover_plugin_odl.driver.ODLTrainer`
streams chunks through the roles with bounded buffers and at-least-once delivery.
"""

from __future__ import annotations

from typing import Any

from dlrover_core import GraphTemplate, RoleTemplate, SpecError, hookimpl
from dlrover_core.plugins.records import Failure, FailureVerdict, StreamSource

DRIVER = "dlrover_plugin_odl.driver:ODLTrainer"
SOURCE_WORKLOAD = "dlrover_plugin_odl.workloads:SourceWorkload"
PREPROCESS_WORKLOAD = "dlrover_plugin_odl.workloads:PreprocessWorkload"
EDGES = (("source", "preprocess"), ("preprocess", "trainer"), ("preprocess", "eval"))
#: ``roles.<role>.config.failover`` the template writes when the job gives none: the
#: stateless ``preprocess`` is replaced under the running driver, which processes the
#: lost chunks again on the replacement and retries the trainer calls that needed them;
#: the other roles restart the driver (see the README's failover table)
FAILOVER_DEFAULTS = {"preprocess": "replace"}
#: the roles the odl driver can replace under itself (``replace`` is refused elsewhere)
REPLACEABLE = ("preprocess",)

_ROLES = {
    "source": "reads the stream (config.odl.source.kind): seek, read, commit",
    "preprocess": "records -> tensors, stateless: process",
    "trainer": "prequential online training, checkpoints with the offsets, publishes "
               "model versions (required): train_step",
    "eval": "scores the live stream with the newest published model: score",
}


def apply_odl(spec: Any) -> None:
    """Template defaults and checks for ``odl``, before anything starts:

    - ``config.odl`` is read (see :class:`~dlrover_plugin_odl.config.ODLConfig`) and
      written back with its defaults;
    - ``config.odl.source.kind`` must be an installed stream source, whose
      ``validate_options`` checks ``config.odl.source.options``;
    - ``roles.source`` / ``roles.preprocess`` left out get the built-in workloads
      (0.5 CPU each); a ``source`` without ``workload`` gets the built-in one;
    - ``checkpoint.every_steps`` >= 1 (the offsets are committed with the trainer's
      checkpoint); ``config.odl.buffer`` >= ``roles.trainer.total``; a trainer with
      several ranks needs a ``backend`` (``ddp``);
    - ``roles.<role>.config.failover`` defaults to ``replace`` for ``preprocess``
      (:data:`FAILOVER_DEFAULTS`: a failed rank is replaced while the driver keeps
      running) and ``rollback`` for the others; ``replace`` is allowed only for
      :data:`REPLACEABLE` roles.

    Raises ``SpecError``.
    """
    from omegaconf import OmegaConf

    from dlrover_core.plugins.manager import UnknownPluginError, get_plugin_manager
    from dlrover_plugin_odl.config import ODLConfig

    if spec.config is None or not OmegaConf.is_dict(spec.config):
        if spec.config not in (None, {}):
            raise SpecError("config", spec.config, "a mapping (the job config)")
        spec.config = {}
    odl = ODLConfig.from_config(spec.config)
    try:
        record = get_plugin_manager().stream_sources.get(odl.source.kind)
    except UnknownPluginError as exc:
        raise SpecError("config.odl.source.kind", odl.source.kind, "an installed stream source",
                        str(exc)) from None
    if record.validate_options is not None:
        try:
            record.validate_options(dict(odl.source.options))
        except SpecError:
            raise
        except (ValueError, TypeError) as exc:
            raise SpecError("config.odl.source.options", odl.source.options,
                            f"options of the {odl.source.kind!r} stream source", str(exc)) from None
    spec.config.odl = odl.as_dict()
    for role, workload in (("source", SOURCE_WORKLOAD), ("preprocess", PREPROCESS_WORKLOAD)):
        if role not in spec.roles:
            from dlrover_core.spec.schema import RoleSpec

            node = OmegaConf.structured(RoleSpec)
            node.workload = workload
            node.resources.cpu = 0.5
            spec.roles[role] = node
        elif role == "source" and OmegaConf.is_missing(spec.roles[role], "workload"):
            spec.roles[role].workload = workload
    from dlrover_core.graph.graph import set_failover_policies

    set_failover_policies(spec.roles, FAILOVER_DEFAULTS, "rollback")
    for role in spec.roles:
        policy = spec.roles[role].config.failover
        if policy == "replace" and role not in REPLACEABLE:
            raise SpecError(f"roles.{role}.config.failover", policy,
                            "rollback (replace only for " + ", ".join(REPLACEABLE) + ")",
                            f"the odl driver cannot put a replaced {role} back where the "
                            "stream is: its failure restarts the driver")
    if all(tuple(e) in EDGES for e in spec.edges):  # the template's own: redo with the new roles
        spec.edges = [list(e) for e in EDGES if e[0] in spec.roles and e[1] in spec.roles]
    if spec.checkpoint.every_steps < 1:
        raise SpecError("checkpoint.every_steps", spec.checkpoint.every_steps,
                        "an integer >= 1 in an odl job",
                        "the stream offsets are committed with the trainer's checkpoint")
    trainer = spec.roles.trainer
    if odl.buffer < trainer.total:
        raise SpecError("config.odl.buffer", odl.buffer,
                        f"at least roles.trainer.total={trainer.total}",
                        "each trainer rank takes one chunk per trainer call")
    if trainer.total > 1 and not trainer.backend:
        raise SpecError("roles.trainer.backend", trainer.backend,
                        "a backend such as ddp when roles.trainer.total > 1",
                        f"{trainer.total} trainer ranks must train one model together")


@hookimpl
def dlrover_graph_templates() -> list[GraphTemplate]:
    return [GraphTemplate(
        name="odl",
        description="online learning: source -> preprocess -> trainer (+ eval) as a stream "
                    "with bounded buffers; offsets committed with the trainer checkpoint",
        roles=(RoleTemplate("source", False, _ROLES["source"]),
               RoleTemplate("preprocess", False, _ROLES["preprocess"]),
               RoleTemplate("trainer", True, _ROLES["trainer"]),
               RoleTemplate("eval", False, _ROLES["eval"])),
        edges=EDGES,
        driver=DRIVER,
        apply=apply_odl,
    )]


def _validate_replay(options: dict) -> None:
    from dlrover_plugin_odl.source import validate_replay_options

    validate_replay_options(options)


def _validate_redis(options: dict) -> None:
    from dlrover_plugin_odl.redis_source import validate_redis_options

    validate_redis_options(options)


@hookimpl
def dlrover_stream_sources() -> list[StreamSource]:
    return [
        StreamSource(name="replay", source="dlrover_plugin_odl.source:ReplaySource",
                     description="embedded: replays an iterable (a dataset, a generator) "
                                 "inside the cluster",
                     validate_options=_validate_replay),
        StreamSource(name="redis", source="dlrover_plugin_odl.redis_source:RedisStreamSource",
                     description="Redis Streams consumer group; XACK after the checkpoint "
                                 "commit (needs the redis extra)",
                     validate_options=_validate_redis),
    ]


@hookimpl
def dlrover_classify_failure(failure: Failure, history: list[Failure]) -> FailureVerdict | None:
    """A stream source that gave up on its broker (``BrokerUnavailable``: it already
    waited ``connect_timeout_s`` at the start, or ``reconnect_timeout_s`` while
    streaming) -> ``fatal``: a restart would only wait again. The reason carries the
    source's message, which names the broker's address. Anything else: ``None``."""
    text = f"{failure.exc_type}\n{failure.message}\n{failure.traceback}"
    if "BrokerUnavailable" not in text:
        return None
    line = next((ln for ln in failure.message.splitlines() if "broker at" in ln),
                failure.message.strip().splitlines()[-1] if failure.message.strip() else "")
    return FailureVerdict("fatal", f"{failure.role or 'a role'}: stream source broker "
                                   f"unavailable: {line.strip()}")
