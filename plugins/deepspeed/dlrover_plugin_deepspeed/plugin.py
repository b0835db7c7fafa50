"""Entry point of the ``deepspeed`` plugin. Imports nothing heavy: deepspeed and torch
are imported by the backend session and the engine in the worker process."""

from __future__ import annotations

from dlrover_core import Backend, StateDictEngine, hookimpl


@hookimpl
def dlrover_backends() -> list[Backend]:
    return [Backend(name="deepspeed", session="dlrover_plugin_deepspeed.backend:DeepSpeedSession",
                    state_dict_engine="deepspeed",
                    description="DeepSpeed engine, ZeRO stages 0-2 (gloo on CPU, NCCL on GPU)")]


@hookimpl
def dlrover_state_dict_engines() -> list[StateDictEngine]:
    return [StateDictEngine(name="deepspeed", engine="dlrover_plugin_deepspeed.engine:DeepSpeedEngineState",
                            description="module, ZeRO optimizer partition and engine counters "
                                        "of a DeepSpeedEngine (same world size on restore)")]
