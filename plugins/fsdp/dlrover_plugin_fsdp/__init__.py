"""DDP and FSDP2 backends for dlrover-core."""

__version__ = "0.1.0"
