"""The core's own defaults, registered through the same hooks as any plugin:
placement policies ``pack`` and ``spread``, the fallback failure classifier, the
``torchrun`` backend of script roles, the ``disk`` saver, the ``plain`` state-dict
engine, and the capture of worker output into the job directory."""

from __future__ import annotations

from dlrover_core.plugins.hookspecs import hookimpl
from dlrover_core.plugins.records import (
    Backend,
    CheckpointSaver,
    Failure,
    FailureVerdict,
    PlacementPolicy,
    StateDictEngine,
)


@hookimpl
def dlrover_placement_policies() -> list[PlacementPolicy]:
    from dlrover_core.builtin.placement import plan_pack, plan_spread

    return [
        PlacementPolicy(name="pack", plan=plan_pack,
                        description="each role's per_node ranks on one node (STRICT_PACK)"),
        PlacementPolicy(name="spread", plan=plan_spread,
                        description="bundles over as many nodes as possible (SPREAD)"),
    ]


@hookimpl
def dlrover_backends() -> list[Backend]:
    return [Backend(name="torchrun", session="dlrover_core.runtime.script:ScriptSession",
                    state_dict_engine="plain",
                    description="script roles (roles.<role>.command): a rendezvous address, "
                                "the script makes its own process group")]


def validate_disk_options(options: dict) -> None:
    """``checkpoint.options`` of the ``disk`` saver (:func:`dlrover_core.checkpoint.disk.
    validate_options`; imported when a spec is checked, not when plugins load)."""
    from dlrover_core.checkpoint.disk import validate_options

    validate_options(options)


@hookimpl
def dlrover_checkpoint_savers() -> list[CheckpointSaver]:
    return [CheckpointSaver(name="disk", saver="dlrover_core.checkpoint.disk:DiskSaver",
                            validate_options=validate_disk_options,
                            description="torch.distributed.checkpoint to a directory, "
                                        "atomic commit with a checksummed manifest")]


@hookimpl
def dlrover_state_dict_engines() -> list[StateDictEngine]:
    return [StateDictEngine(name="plain", engine="dlrover_core.checkpoint.engine:PlainEngine",
                            description="state_dict()/load_state_dict() of each object")]


@hookimpl(trylast=True)
def dlrover_classify_failure(failure: Failure, history: list[Failure]) -> FailureVerdict:
    from dlrover_core.builtin.failure import classify

    return classify(failure, history)


@hookimpl
def dlrover_tuners() -> list:
    from dlrover_core.plugins.records import Tuner

    return [
        Tuner(name="dataloader_workers",
              tuner="dlrover_core.tuning.builtin_tuners:DataloaderWorkersTuner",
              description="raise dataloader.num_workers while data wait is a large share "
                          "of the step"),
        Tuner(name="micro_batch", tuner="dlrover_core.tuning.builtin_tuners:MicroBatchTuner",
              description="grow the micro-batch (global batch kept) while throughput rises "
                          "and memory allows"),
        Tuner(name="global_batch", tuner="dlrover_core.tuning.builtin_tuners:GlobalBatchTuner",
              description="opt-in: double the global batch (gradient accumulation) up to "
                          "max_global_batch; the learning rate follows tuning.lr_scaling"),
    ]


@hookimpl(tryfirst=True)
def dlrover_workload_setup(workload) -> None:
    """Worker output of every (re)start to ``<job_dir>/logs/<role>-<rank>/attempt-<N>.log``
    (``dlrover logs``; see :mod:`dlrover_core.runtime.log_capture`); first, so that what
    other plugins' setup hooks print is captured too."""
    from dlrover_core.runtime import attempt_log
    from dlrover_core.runtime.log_capture import capture_output

    ctx = workload.context
    capture_output(ctx.job_dir, ctx.role, ctx.rank, ctx.attempt,
                   getattr(ctx, "observability", None))
    attempt_log.install()  # the workload's logging records and warnings go there too
    attempt_log.header(ctx)
