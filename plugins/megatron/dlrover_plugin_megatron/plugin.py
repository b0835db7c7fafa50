"""Entry point of the ``megatron`` plugin. Imports nothing heavy: torch and
megatron-core are imported by the backend session and the engine in the worker."""

from __future__ import annotations

from dlrover_core import Backend, Failure, FailureVerdict, StateDictEngine, hookimpl
from dlrover_plugin_megatron import failures
from dlrover_plugin_megatron.settings import validate_role


@hookimpl
def dlrover_backends() -> list[Backend]:
    return [Backend(name="megatron", session="dlrover_plugin_megatron.backend:MegatronSession",
                    state_dict_engine="megatron", validate_role=validate_role,
                    description="megatron-core parallel_state: tensor, pipeline and context "
                                "parallel groups (gloo on CPU, NCCL on GPU)")]


@hookimpl
def dlrover_state_dict_engines() -> list[StateDictEngine]:
    return [StateDictEngine(name="megatron", engine="dlrover_plugin_megatron.engine:MegatronEngine",
                            description="megatron-core sharded state dict as DTensors: "
                                        "reshards between TP/PP layouts (disk saver)")]


@hookimpl
def dlrover_classify_failure(failure: Failure, history: list[Failure]) -> FailureVerdict | None:
    return failures.classify(failure, history)
