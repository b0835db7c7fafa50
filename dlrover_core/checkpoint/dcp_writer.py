"""DCP's ``FileSystemWriter`` with the crash points of the disk saver's shard writes
(:mod:`dlrover_core.crashpoints`): each rank's files, their fsync, rank 0's
``.metadata``. torch is imported when the first writer is made, not at import."""

from __future__ import annotations

from typing import Any

from dlrover_core.crashpoints import crashpoint, declare

declare("disk.save.shard_write", "io", "save", "a rank writes its shard files (DCP)")
declare("disk.save.shard_synced", "state", "save",
        "a rank's shard files are written and fsynced, the step not yet committed")
declare("disk.save.metadata", "io", "save", "rank 0 writes DCP's .metadata file")


def _writer_class() -> type:
    """DCP's ``FileSystemWriter`` with the crash points of a rank's shard write (the
    files) and of rank 0's ``.metadata`` (torch is imported here, not at module import)."""
    import torch.distributed.checkpoint as dcp

    class Writer(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            crashpoint("disk.save.shard_write")
            written = super().write_data(plan, planner)
            written.wait()
            crashpoint("disk.save.shard_synced")
            return written

        def finish(self, metadata: Any, results: Any) -> None:
            crashpoint("disk.save.metadata")
            super().finish(metadata, results)

    return Writer


def writer(path: str, sync_files: bool = True) -> Any:
    """A :func:`_writer_class` writer of ``path`` (one class per process)."""
    global _WRITER
    if _WRITER is None:
        _WRITER = _writer_class()
    return _WRITER(path, sync_files=sync_files)


_WRITER: type | None = None
