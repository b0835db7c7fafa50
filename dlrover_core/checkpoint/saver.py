"""The saver interface (``checkpoint.saver``) and committed-step helpers.

``fsync_dir``, ``atomic_write_text`` and ``atomic_write_json`` live in
:mod:`dlrover_core.atomic_io`; they are re-exported here for savers that import them
from this module."""

from __future__ import annotations

import logging
import os
import re
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from dlrover_core.atomic_io import (
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    recover_aside,
    replace_dir,
)
from dlrover_core.crashpoints import crashpoint, declare

__all__ = ["STEP_DIR_RE", "Saver", "SaverConfig", "SaverContext", "atomic_write_json",
           "atomic_write_text", "committed_steps", "fsync_dir", "prune", "quarantine",
           "replace_dir", "step_dir_name"]

log = logging.getLogger(__name__)

declare("disk.prune.remove", "io", "prune", "prune removes an old committed step_<n> folder")

STEP_DIR_RE = re.compile(r"^step_(\d{8,})$")
_ASIDE_RE = re.compile(r"^(step_\d{8,})\.replaced$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class SaverConfig:
    """``dir``: committed steps go to ``<dir>/step_<step>``; ``keep``: newest committed
    steps kept; ``job``: job name (for shared-memory names); ``options``: the job's
    ``checkpoint.options`` (saver-specific); ``run_id``: this run of the job (see
    ``WorkerContext.run_id``); ``job_dir``: the job directory."""

    dir: str
    keep: int = 3
    job: str = ""
    options: dict = field(default_factory=dict)
    run_id: str = ""
    job_dir: str = ""


@dataclass
class SaverContext:
    """Where the saver runs: ``rank``/``world_size`` within the role, ``local_rank``,
    ``role``, and ``distributed`` (a torch.distributed group is initialised)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    role: str = ""
    distributed: bool = False


class Saver(ABC):
    """Writes and reads state dicts for one rank; constructed in the worker process as
    ``cls(config, context)``.

    A ``state_dict`` is a nested dict of tensors (``torch.Tensor`` or ``DTensor``) and
    small picklable values, as a ``StateDictEngine`` produces it.
    """

    #: where the last :meth:`load` read from (``memory``, ``disk``, ...); set by the saver
    last_load_source: str | None = None

    def __init__(self, config: SaverConfig, context: SaverContext) -> None:
        self.config = config
        self.context = context

    @abstractmethod
    def save(self, step: int, state_dict: dict) -> None:
        """Save ``step``; may return before the step is committed to storage."""

    @abstractmethod
    def load(self, state_dict: dict, step: int | None = None) -> int | None:
        """Load the newest committed step (or ``step``) into ``state_dict`` in place;
        return the step, or ``None`` when there is none. When committed steps exist
        but none loads, raise (``CheckpointLoadError``) rather than return ``None``: a
        ``None`` restarts training from step 0."""

    def committed_steps(self) -> list[int]:
        """Committed steps on storage, oldest first."""
        return committed_steps(self.config.dir)

    def wait(self) -> None:
        """Block until every save started so far is committed."""

    def drain(self) -> None:
        """Called when a run returns: block until every save whose commit needs this
        process alive (a background thread of it) is committed, and raise what it
        raised. Default: nothing (a saver that commits elsewhere, or synchronously)."""

    def close(self) -> None:
        """Release resources (threads, buffers)."""

    def reserve_for(self, state_dict: dict, wait: bool = False) -> Any:
        """Get ready to save ``state_dict`` (the live state, as given to :meth:`load`):
        called by the :class:`~dlrover_core.checkpoint.checkpointer.Checkpointer` after
        the state was restored without this saver (healed from a survivor's live state),
        where no :meth:`load` laid anything out. The flash saver lays out its shared-memory
        buffers for it in the background, as after its own load, so that the first saves
        do not. ``wait``: block until done. Default: nothing (returns ``None``)."""
        return None

    def close_for_resetup(self) -> None:
        """Called instead of :meth:`close` when this process sets the same role instance
        up again in place (a survivor after a peer failed) and makes a new saver: a
        saver may hand what the next one can reuse on (the flash saver its filled
        mappings of the slots). Default: :meth:`close`."""
        self.close()

    @classmethod
    def prepare_standby(cls, config: SaverConfig, context: SaverContext) -> None:
        """Called once in a warm standby process (``failover.standby: true``) by its
        ``prepare()``, before it knows which rank it will replace: get ready to load
        fast once promoted (the flash saver maps this node's buffers of the role).
        ``context.rank`` is the spare's placeholder. Must not block for long or raise
        for a missing checkpoint. Default: nothing."""


def committed_steps(directory: str) -> list[int]:
    """Steps with a committed ``step_<n>`` directory under ``directory``, oldest first.

    Quarantined steps (``step_<n>.corrupt``, see :func:`quarantine`) are not listed. A
    step whose replacement crashed between two renames (``step_<n>.replaced`` only,
    see :func:`dlrover_core.atomic_io.replace_dir`) is put back first."""
    if not os.path.isdir(directory):
        return []
    names = os.listdir(directory)
    for name in names:
        m = _ASIDE_RE.match(name)
        if m:
            recover_aside(os.path.join(directory, m.group(1)))
    steps = []
    for name in os.listdir(directory):
        m = STEP_DIR_RE.match(name)
        if m and os.path.exists(os.path.join(directory, name, "manifest.json")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def prune(directory: str, keep: int, steps: list[int] | None = None,
          protect: int | None = None) -> list[int]:
    """Delete all but the newest ``keep`` of ``steps`` (default: the committed steps),
    never ``protect`` (the step just committed); returns the deleted steps."""
    steps = committed_steps(directory) if steps is None else sorted(steps)
    old = steps[:-keep] if keep > 0 else []
    old = [s for s in old if s != protect]
    for s in old:
        crashpoint("disk.prune.remove")
        shutil.rmtree(os.path.join(directory, step_dir_name(s)), ignore_errors=True)
    return old


def quarantine(directory: str, step: int, reason: str) -> str | None:
    """Rename the committed ``step`` that failed its check to ``step_<n>.corrupt``
    (``.corrupt-2``, ... when taken), so that no listing, commit, prune or load
    counts it again; the files stay for inspection. Returns the new path, or ``None``
    when the step is gone already (pruned by another process)."""
    src = os.path.join(directory, step_dir_name(step))
    for k in range(1, 100):
        dst = f"{src}.corrupt" + (f"-{k}" if k > 1 else "")
        if os.path.exists(dst):
            continue
        try:
            os.rename(src, dst)
        except FileNotFoundError:
            return None
        except OSError:
            continue  # taken meanwhile
        fsync_dir(directory)
        log.warning("quarantined checkpoint step %d as %s: %s", step, os.path.basename(dst),
                    reason)
        return dst
    return None
