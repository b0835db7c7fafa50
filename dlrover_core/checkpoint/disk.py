"""The built-in ``disk`` saver: torch.distributed.checkpoint to a directory, committed
atomically.

Save (blocking): every rank writes its shards with DCP into ``.step_<n>.tmp/``
(files fsynced); rank 0 writes ``manifest.json`` (sizes + sha256 of every file),
fsyncs, moves the directory to ``step_<n>`` (an existing ``step_<n>``, a re-save after
a restart from an older step, is swapped in one step:
:func:`dlrover_core.atomic_io.replace_dir`), updates ``latest`` atomically and prunes
to ``keep`` steps, never the one just saved; a barrier ends the save on every rank.
Load: the newest step whose manifest verifies; a step whose file has another size or
sha256 is quarantined (``step_<n>.corrupt``) and skipped with a warning; when
committed steps exist but none loads, :class:`CheckpointLoadError` is raised (never
``None``: that would restart training from step 0). With a torch.distributed group,
rank 0 picks the step and broadcasts it.

``dir`` may be a URI (:mod:`dlrover_core.checkpoint.storage`): ``file:///path`` is the
local path; another fsspec protocol stages each step in a local temporary folder,
uploads it and commits it on the store (``RemoteSteps``), and a load downloads the
step and verifies it as above before reading it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

from dlrover_core.checkpoint.manifest import (
    MANIFEST,
    CheckpointLoadError,
    CorruptCheckpointError,
    DamagedStepError,
    build_manifest,
    verify,
)
from dlrover_core.checkpoint.saver import (
    Saver,
    atomic_write_json,
    atomic_write_text,
    committed_steps,
    fsync_dir,
    prune,
    quarantine,
    replace_dir,
    step_dir_name,
)
from dlrover_core.checkpoint.storage import RemoteSteps, local_path

log = logging.getLogger(__name__)


def _dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class DiskSaver(Saver):
    def _barrier(self) -> None:
        dist = _dist()
        if dist is not None:
            dist.barrier()

    def _remote(self) -> RemoteSteps | None:
        """The store of a non-local ``dir`` URI; ``None`` for a local path."""
        if local_path(self.config.dir) is not None:
            return None
        if getattr(self, "_store", None) is None:
            self._store = RemoteSteps(self.config.dir)
        return self._store

    def committed_steps(self) -> list[int]:
        store = self._remote()
        if store is not None:
            return store.committed_steps()
        return committed_steps(str(local_path(self.config.dir)))

    def _save_remote(self, store: RemoteSteps, step: int, state_dict: dict) -> None:
        import torch.distributed.checkpoint as dcp

        if self.context.rank == 0:
            store.clear(store.tmp_name(step))
        self._barrier()
        stage = tempfile.mkdtemp(prefix=f"dlrover-{step_dir_name(step)}-")
        try:  # every rank writes its own shards here, then uploads them
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(stage, sync_files=True),
                     no_dist=_dist() is None)
            store.upload(stage, store.tmp_name(step))
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        self._barrier()
        if self.context.rank == 0:
            store.commit(step, {"world_size": self.context.world_size, "format": "dcp"})
            store.prune(self.config.keep, protect=step)
        self._barrier()

    def save(self, step: int, state_dict: dict) -> None:
        import torch.distributed.checkpoint as dcp

        store = self._remote()
        if store is not None:
            return self._save_remote(store, step, state_dict)
        directory = str(local_path(self.config.dir))
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
            fsync_dir(tmp)
            old = replace_dir(tmp, final)  # the old step_<n> stays whole until the swap
            if old:
                shutil.rmtree(old, ignore_errors=True)
            atomic_write_text(os.path.join(directory, "latest"), f"{step}\n")
            prune(directory, self.config.keep, protect=step)
        self._barrier()

    def _pick_step(self, step: int | None) -> tuple[int | None, dict[int, str]]:
        """(the newest step that verifies, or ``None``; the steps tried before and why
        each failed). A damaged step is quarantined."""
        store = self._remote()
        directory = str(local_path(self.config.dir)) if store is None else ""
        candidates = [step] if step is not None else self.committed_steps()[::-1]
        tried: dict[int, str] = {}
        for s in candidates:
            scratch = tempfile.mkdtemp(prefix="dlrover-verify-") if store else ""
            try:
                verify(store.download(s, scratch) if store else
                       os.path.join(directory, step_dir_name(s)))
                return s, tried
            except CorruptCheckpointError as exc:
                log.warning("skipping checkpoint step %d: %s", s, exc)
                tried[s] = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, DamagedStepError):
                    if store:
                        store.quarantine(s)
                    else:
                        quarantine(directory, s, str(exc))
            finally:
                if scratch:
                    shutil.rmtree(scratch, ignore_errors=True)
        return None, tried

    def load(self, state_dict: dict, step: int | None = None) -> int | None:
        """Load the newest committed step that verifies (or ``step``) into
        ``state_dict`` in place; ``None`` when no step is committed.

        Raises:
            CheckpointLoadError: committed steps exist but none verified or loaded
                (each step tried and why).
        """
        import torch.distributed.checkpoint as dcp

        dist = _dist()
        picked: tuple[int | None, dict[int, str]] = (None, {})
        if self.context.rank == 0 or dist is None:
            picked = self._pick_step(step)
        if dist is not None:
            box = [picked]
            dist.broadcast_object_list(box, src=0)
            picked = box[0]
        chosen, tried = picked
        if chosen is None:
            if tried:
                raise CheckpointLoadError(self.config.dir, tried)
            return None
        from torch.distributed.checkpoint.api import CheckpointException

        store = self._remote()
        scratch = tempfile.mkdtemp(prefix="dlrover-load-") if store else ""
        try:
            if store:  # every rank reads the step from its own verified local copy
                path = store.download(chosen, scratch)
                verify(path)
            else:
                path = os.path.join(str(local_path(self.config.dir)), step_dir_name(chosen))
            dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path),
                     no_dist=dist is None)
        # the live state may be partly overwritten now (CheckpointException is a
        # BaseException)
        except (Exception, CheckpointException) as exc:
            tried[chosen] = f"{type(exc).__name__}: {exc}"
            raise CheckpointLoadError(self.config.dir, tried) from exc
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
        self.last_load_source = "disk"
        return chosen
