"""The flash-checkpoint saver for dlrover-core: save in memcpy time into shared
memory, persist asynchronously from a per-node process, never lose a step.

``FlashCheckpointer`` (:mod:`.checkpointer`) is the API for plain torchrun scripts;
it is imported on first use (torch is not imported by this package's import)."""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "FlashCheckpointer":
        from dlrover_plugin_flashckpt.checkpointer import FlashCheckpointer

        return FlashCheckpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
