"""Every hook of dlrover-core, grouped by phase. The docstrings are the reference.

Plugins implement hooks with ``@dlrover_core.hookimpl`` in the module their
``dlrover.plugins`` entry point names::

    # pyproject.toml of dlrover-plugin-mine
    [project.entry-points."dlrover.plugins"]
    mine = "dlrover_plugin_mine.plugin"

That module must import nothing heavy (torch, megatron, deepspeed): records
point at implementations by import path and are resolved where they run.

Processes: *master* hooks run inside the JobMaster actor, *worker* hooks inside
the Ray actor of a role instance, *client* hooks in the ``dlrover`` command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from dlrover_core.plugins.records import (
        Backend,
        CheckpointSaver,
        Failure,
        FailureVerdict,
        GraphTemplate,
        PlacementPolicy,
        StateDictEngine,
        StreamSource,
        Tuner,
    )
    from dlrover_core.runtime.workload import BaseWorkload

PROJECT = "dlrover"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------- registration
@hookspec
def dlrover_graph_templates() -> list[GraphTemplate]:
    """Return the graph templates this plugin provides. Called once per process, on load.

    Example::

        @hookimpl
        def dlrover_graph_templates():
            return [GraphTemplate(name="sft", roles=(RoleTemplate("trainer"),),
                                  description="one SPMD trainer group")]
    """


@hookspec
def dlrover_backends() -> list[Backend]:
    """Return the SPMD backends this plugin provides. Called once per process, on load.

    Example::

        @hookimpl
        def dlrover_backends():
            return [Backend(name="fsdp", session="dlrover_plugin_fsdp.backend:FSDPSession")]
    """


@hookspec
def dlrover_state_dict_engines() -> list[StateDictEngine]:
    """Return state-dict engines (how a backend's objects become a saveable state
    dict). Called once per process, on load.

    Example::

        @hookimpl
        def dlrover_state_dict_engines():
            return [StateDictEngine(name="dcp", engine="dlrover_plugin_fsdp.engine:DCPEngine")]
    """


@hookspec
def dlrover_checkpoint_savers() -> list[CheckpointSaver]:
    """Return checkpoint savers. Called once per process, on load.

    Example::

        @hookimpl
        def dlrover_checkpoint_savers():
            return [CheckpointSaver(name="flash", saver="dlrover_plugin_flashckpt.saver:FlashSaver")]
    """


@hookspec
def dlrover_placement_policies() -> list[PlacementPolicy]:
    """Return placement policies. Called once per process, on load.

    Example::

        @hookimpl
        def dlrover_placement_policies():
            return [PlacementPolicy(name="pack", plan=plan_pack)]
    """


@hookspec
def dlrover_tuners() -> list[Tuner]:
    """Return tuners. Called once per process, on load.

    Example::

        @hookimpl
        def dlrover_tuners():
            return [Tuner(name="mbs", tuner="dlrover_plugin_mine.tuner:MicroBatchTuner")]
    """


@hookspec
def dlrover_stream_sources() -> list[StreamSource]:
    """Return stream sources (what the ``odl`` template's ``source`` role reads:
    ``config.odl.source.kind`` names one). Called once per process, on load.

    Example::

        @hookimpl
        def dlrover_stream_sources():
            return [StreamSource(name="redis", source="dlrover_plugin_odl.redis_source:RedisStreamSource")]
    """


@hookspec
def dlrover_cli_commands(cli: Any) -> None:
    """Add sub-commands to the ``dlrover`` command (client process).

    Args:
        cli: the ``argparse`` sub-parsers object; call ``cli.add_parser(name, help=...)``
            and ``set_defaults(func=handler)`` where ``handler(args) -> int`` returns
            the exit code.
    """


# --------------------------------------------------------------------------- workload lifecycle
@hookspec
def dlrover_workload_setup(workload: BaseWorkload) -> None:
    """A role instance is about to run its ``setup()``: its context (rank, world_size,
    env, backend session) is ready. Worker process."""


@hookspec
def dlrover_workload_started(workload: BaseWorkload) -> None:
    """A role instance finished ``setup()`` and starts its work. Worker process."""


@hookspec
def dlrover_step_reported(job: str, role: str, rank: int, step: int, metrics: dict) -> None:
    """A role instance reported a step (``BaseWorkload.report``). Master process.

    Args:
        metrics: name -> float, e.g. ``{"loss": 2.1, "samples_per_s": 530.0}``.
    """


@hookspec
def dlrover_workload_stopped(job: str, role: str, rank: int, status: str) -> None:
    """A role instance ended normally (``status`` ``succeeded`` or ``stopped``). Master process."""


@hookspec
def dlrover_workload_failed(job: str, failure: Failure, verdict: FailureVerdict,
                            emit: Any) -> None:
    """A failure was classified; ``verdict.level`` is the recovery that follows; it runs
    before the recovery starts. Master process.

    Args:
        emit: ``emit(event: str, **fields)`` appends an event to the job's
            ``events.jsonl`` (e.g. what a breakpoint save did).
    """


@hookspec
def dlrover_job_finished(job: str, summary: dict, emit: Any, spec: Any) -> None:
    """The job ended (also after ``dlrover stop``); ``summary`` is what ``summary.json``
    holds. Master process. ``emit`` as in :func:`dlrover_workload_failed`; the
    ``job_finished`` event comes after this hook's events. ``spec``: the job's spec
    (``DictConfig``; ``None`` when called outside a JobMaster). A hook may add keys to
    ``summary`` (e.g. what it could not finish); ``summary.json`` is written again
    after the hooks, its ``ended_at``, ``wall_s`` and ``goodput`` then counting the
    hooks' time (the job has ended when they returned)."""


@hookspec
def dlrover_job_health(job: str, spec: Any) -> dict | None:
    """What the plugin sees wrong with the running job ``job`` outside its processes:
    ``{check name: details (a JSON-able dict)}``, or ``{}`` / ``None`` when all is well.
    Master process, from a background thread every ``HEALTH_INTERVAL_S`` (10 s) while
    the job runs (:mod:`dlrover_core.master.health`); it should return within a few
    seconds. ``spec``: the job's spec (``DictConfig``). The master lists what fails
    under ``status()["health"]`` and emits ``health_failing`` / ``health_recovered``.

    Example (the flash saver)::

        @hookimpl
        def dlrover_job_health(job, spec):
            failing = persist_failures(job)   # node -> {"what", "error", "since", ...}
            return {"checkpoint_persist": failing} if failing else None
    """


@hookspec
def dlrover_job_deleted(job: str, job_dir: str) -> list[str]:
    """``dlrover delete`` removed the job directory ``job_dir`` of the finished job
    ``job``. Client process (the command), Ray not needed. Remove what the plugin keeps
    for the job outside that directory on this machine (the flash saver: its
    shared-memory buffers) and return one line per thing removed, shown to the user.

    Example::

        @hookimpl
        def dlrover_job_deleted(job, job_dir):
            return [f"removed cache {p}" for p in remove_my_cache(job)]
    """


# --------------------------------------------------------------------------- failure classification
@hookspec(firstresult=True)
def dlrover_classify_failure(failure: Failure, history: list[Failure]) -> FailureVerdict | None:
    """Classify a failure into a failover level. Master process. ``firstresult``: the
    first non-``None`` answer wins, so a plugin that recognises an error (an NCCL
    timeout, a Megatron assertion) answers before the built-in classifier, which is
    registered ``trylast`` and always answers.

    Args:
        failure: what failed.
        history: earlier failures of the same job, oldest first.
    Returns:
        a ``FailureVerdict`` or ``None`` to let the next classifier decide.
    """
