"""The Megatron-Core backend for dlrover-core."""

__version__ = "0.1.0"
