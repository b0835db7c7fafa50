"""Published model versions: what a serving process (or the ``eval`` role) loads.

Layout under a directory (``<job dir>/published`` in an ``odl`` job)::

    version_00000050/model.pt        torch.save of the model's state dict
    version_00000050/meta.json       {"version", "step", "records", ...}
    version_00000050/manifest.json   sizes and sha256 of both (dlrover_core's manifest)
    latest                           "50"

A version is written to a hidden temp directory, fsynced, given its manifest and
moved into place (:func:`dlrover_core.atomic_io.replace_dir`: a version published
again is swapped in one step, the old copy is never deleted first); ``latest`` is
replaced atomically after that, so a reader sees either the previous version or the
complete new one. :func:`load_latest` verifies
the manifest and falls back to the previous version when the newest is corrupt.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

from dlrover_core.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpointError,
    build_manifest,
    verify,
)
from dlrover_core.atomic_io import recover_aside, replace_dir
from dlrover_core.checkpoint.saver import (
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
)

log = logging.getLogger(__name__)
_PREFIX = "version_"


def version_dir(directory: str, version: int) -> str:
    return os.path.join(directory, f"{_PREFIX}{version:08d}")


def versions(directory: str) -> list[int]:
    """Versions with a manifest under ``directory``, oldest first."""
    if not os.path.isdir(directory):
        return []
    for name in os.listdir(directory):  # a replacement that crashed between renames
        if name.startswith(_PREFIX) and name.endswith(".replaced"):
            recover_aside(os.path.join(directory, name[:-len(".replaced")]))
    out = []
    for name in os.listdir(directory):
        if name.startswith(_PREFIX) and name[len(_PREFIX):].isdigit() and \
                os.path.exists(os.path.join(directory, name, MANIFEST)):
            out.append(int(name[len(_PREFIX):]))
    return sorted(out)


def publish(directory: str, version: int, state_dict: dict, meta: dict | None = None,
            keep: int = 3) -> str:
    """Write ``state_dict`` (a model's, tensors) as ``version`` and point ``latest`` at
    it; keep the newest ``keep`` versions. Returns the version directory."""
    import torch

    os.makedirs(directory, exist_ok=True)
    final = version_dir(directory, version)
    tmp = os.path.join(directory, f".{_PREFIX}{version:08d}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, "model.pt"), "wb") as f:
        torch.save(state_dict, f)
        f.flush()
        os.fsync(f.fileno())
    atomic_write_json(os.path.join(tmp, "meta.json"), {"version": version, **(meta or {})})
    atomic_write_json(os.path.join(tmp, MANIFEST), build_manifest(tmp, version))
    fsync_dir(tmp)
    old = replace_dir(tmp, final)  # fsyncs the directory
    if old:
        shutil.rmtree(old, ignore_errors=True)
    atomic_write_text(os.path.join(directory, "latest"), f"{version}\n")
    for old in versions(directory)[:-keep] if keep > 0 else []:
        shutil.rmtree(version_dir(directory, old), ignore_errors=True)
    return final


def latest_version(directory: str) -> int | None:
    """The version ``latest`` names, or ``None``."""
    try:
        with open(os.path.join(directory, "latest")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def load_latest(directory: str) -> tuple[int, dict, dict] | None:
    """``(version, state_dict, meta)`` of the newest version whose manifest verifies
    (tensors on CPU), or ``None`` when there is none."""
    import torch

    candidates = versions(directory)[::-1]
    for v in candidates:
        path = version_dir(directory, v)
        try:
            verify(path)
        except CorruptCheckpointError as exc:
            log.warning("skipping published version %d: %s", v, exc)
            continue
        except FileNotFoundError:  # pruned meanwhile
            continue
        try:
            state = torch.load(os.path.join(path, "model.pt"), map_location="cpu",
                               weights_only=True)
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
        except FileNotFoundError:
            continue
        return v, state, meta
    return None


def load_into(model: Any, directory: str) -> int | None:
    """Load the newest published version into ``model`` in place; returns the
    version or ``None``."""
    got = load_latest(directory)
    if got is None:
        return None
    model.load_state_dict(got[1])
    return got[0]
