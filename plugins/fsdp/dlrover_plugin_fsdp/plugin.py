"""Entry point of the ``fsdp`` plugin. Imports nothing heavy: torch is imported by the
backend session in the worker process."""

from __future__ import annotations

from dlrover_core import Backend, StateDictEngine, hookimpl


@hookimpl
def dlrover_backends() -> list[Backend]:
    return [
        Backend(name="ddp", session="dlrover_plugin_fsdp.backend:DDPSession",
                state_dict_engine="dcp",
                description="DistributedDataParallel (gloo on CPU, NCCL on GPU)"),
        Backend(name="fsdp", session="dlrover_plugin_fsdp.backend:FSDPSession",
                state_dict_engine="dcp",
                description="FSDP2 fully_shard on a 1-D DeviceMesh (gloo on CPU, NCCL on GPU)"),
    ]


@hookimpl
def dlrover_state_dict_engines() -> list[StateDictEngine]:
    return [StateDictEngine(name="dcp", engine="dlrover_plugin_fsdp.engine:DCPEngine",
                            description="torch.distributed.checkpoint.state_dict: sharded "
                                        "model + optimizer state")]
