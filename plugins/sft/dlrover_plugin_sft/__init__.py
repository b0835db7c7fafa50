"""The sft graph template for dlrover-core."""

__version__ = "0.1.0"
