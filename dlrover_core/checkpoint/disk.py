"""The built-in ``disk`` saver: torch.distributed.checkpoint to a directory, committed
atomically.

Save (blocking): every rank writes its shards with DCP into ``.tmp_step_<n>/``
(files fsynced); rank 0 writes ``manifest.json`` (sizes + sha256 of every file),
fsyncs, renames the directory to ``step_<n>``, updates ``latest`` atomically and
prunes to ``keep`` steps; a barrier ends the save on every rank.
Load: the newest step whose manifest verifies; corrupt steps are skipped with a
warning. With a torch.distributed group, rank 0 picks the step and broadcasts it.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from dlrover_core.checkpoint.manifest import MANIFEST, CorruptCheckpointError, build_manifest, verify
from dlrover_core.checkpoint.saver import (
    Saver,
    atomic_write_json,
    atomic_write_text,
    committed_steps,
    fsync_dir,
    prune,
    step_dir_name,
)

log = logging.getLogger(__name__)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class DiskSaver(Saver):
    def _barrier(self) -> None:
        dist = _dist()
        if dist is not None:
            dist.barrier()

    def save(self, step: int, state_dict: dict) -> None:
        import torch.distributed.checkpoint as dcp

        directory = self.config.dir
        final = os.path.join(directory, step_dir_name(step))
        tmp = os.path.join(directory, "." + step_dir_name(step) + ".tmp")
        if self.context.rank == 0:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self._barrier()
        writer = dcp.FileSystemWriter(tmp, sync_files=True)
        dcp.save(state_dict, storage_writer=writer, no_dist=_dist() is None)
        if self.context.rank == 0:
            manifest = build_manifest(tmp, step, {"world_size": self.context.world_size,
                                                  "format": "dcp"})
            atomic_write_json(os.path.join(tmp, MANIFEST), manifest)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(directory)
            atomic_write_text(os.path.join(directory, "latest"), f"{step}\n")
            prune(directory, self.config.keep)
        self._barrier()

    def _pick_step(self, step: int | None) -> int | None:
        directory = self.config.dir
        candidates = [step] if step is not None else committed_steps(directory)[::-1]
        for s in candidates:
            path = os.path.join(directory, step_dir_name(s))
            try:
                verify(path)
                return s
            except CorruptCheckpointError as exc:
                log.warning("skipping checkpoint step %d: %s", s, exc)
        return None

    def load(self, state_dict: dict, step: int | None = None) -> int | None:
        import torch.distributed.checkpoint as dcp

        dist = _dist()
        chosen = self._pick_step(step) if self.context.rank == 0 or dist is None else None
        if dist is not None:
            box = [chosen]
            dist.broadcast_object_list(box, src=0)
            chosen = box[0]
        if chosen is None:
            return None
        path = os.path.join(self.config.dir, step_dir_name(chosen))
        dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path), no_dist=dist is None)
        self.last_load_source = "disk"
        return chosen
