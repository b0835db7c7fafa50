"""Checkpointing: the Checkpointer facade, saver and engine interfaces, the disk saver."""

from dlrover_core.checkpoint.checkpointer import Checkpointer
from dlrover_core.checkpoint.engine import PlainEngine, StateDictEngineBase
from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_core.checkpoint.saver import Saver, SaverConfig, SaverContext

__all__ = ["Checkpointer", "CorruptCheckpointError", "PlainEngine", "Saver", "SaverConfig",
           "SaverContext", "StateDictEngineBase"]
