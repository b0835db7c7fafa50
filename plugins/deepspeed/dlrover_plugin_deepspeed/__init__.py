"""The DeepSpeed backend for dlrover-core."""

__version__ = "0.1.0"
