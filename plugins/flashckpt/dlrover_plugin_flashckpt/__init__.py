"""The flash-checkpoint saver for dlrover-core: save in memcpy time into shared
memory, persist asynchronously from a per-node process, never lose a step."""

__version__ = "0.1.0"
