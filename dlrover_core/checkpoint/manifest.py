"""Checkpoint manifests: sizes and checksums of every file of a committed step."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Callable

MANIFEST = "manifest.json"


class CorruptCheckpointError(RuntimeError):
    """A committed step's files do not match its manifest."""


class DamagedStepError(CorruptCheckpointError):
    """A committed step's file has another size or checksum than its manifest says:
    the step is quarantined (:func:`dlrover_core.checkpoint.saver.quarantine`) by
    whoever finds it. A missing file or manifest is not "damaged" (a prune may be
    racing the reader)."""


class CheckpointLoadError(RuntimeError):
    """Committed steps exist but none could be loaded; ``tried`` maps each step tried
    to why it failed (the message lists them). Raised instead of returning ``None``, so
    that a job never restarts from step 0 over a checkpoint it failed to read."""

    def __init__(self, directory: str, tried: dict[int, str]) -> None:
        self.directory = directory
        self.tried = dict(tried)
        lines = "; ".join(f"step {s}: {why}" for s, why in sorted(tried.items(), reverse=True))
        super().__init__(f"{directory}: committed checkpoint steps exist but none loaded "
                         f"(tried {len(tried)}): {lines}")

    def __reduce__(self):  # keep the attributes when Ray pickles it
        return (CheckpointLoadError, (self.directory, self.tried))


def file_digest(path: str, chunk: int = 8 << 20) -> str:
    """``sha256`` hex digest of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def build_manifest(step_dir: str, step: int, extra: dict | None = None) -> dict:
    """Manifest of every file under ``step_dir`` (except the manifest itself)."""
    files = {}
    for root, _, names in os.walk(step_dir):
        for n in sorted(names):
            p = os.path.join(root, n)
            rel = os.path.relpath(p, step_dir)
            if rel == MANIFEST:
                continue
            files[rel] = {"bytes": os.path.getsize(p), "sha256": file_digest(p)}
    return {"step": step, "created": time.time(), "files": files, **(extra or {})}


def read_manifest_file(step_dir: str) -> dict:
    """The parsed ``manifest.json`` of ``step_dir`` (any saver's format).

    Raises:
        CorruptCheckpointError: the manifest is missing or not JSON.
    """
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"{step_dir}: unreadable manifest ({exc})") from None


def check_file(step_dir: str, rel: str, meta: dict, key: str = "sha256",
               digest: Callable[[str], Any] = file_digest) -> None:
    """Check the file ``rel`` of ``step_dir`` against its manifest entry ``meta``: it
    exists, has ``meta["bytes"]`` bytes and ``digest(path) == meta[key]`` (default: the
    sha256 hex digest, :func:`file_digest`; the flash saver passes ``"crc32"``).

    Raises:
        DamagedStepError: a size or checksum mismatch (the message names the file).
        CorruptCheckpointError: the file is missing.
    """
    path = os.path.join(step_dir, rel)
    if not os.path.exists(path):
        raise CorruptCheckpointError(f"{step_dir}: file {rel} is missing")
    size = os.path.getsize(path)
    if size != meta["bytes"]:
        raise DamagedStepError(
            f"{step_dir}: {rel} has {size} bytes, the manifest says {meta['bytes']}")
    if digest(path) != meta[key]:
        raise DamagedStepError(
            f"{step_dir}: {rel} {key} checksum does not match the manifest")


def verify(step_dir: str) -> dict:
    """Check sizes and checksums against the manifest; return the manifest.

    Raises:
        DamagedStepError: a size or checksum mismatch.
        CorruptCheckpointError: missing manifest or file.
    """
    manifest = read_manifest_file(step_dir)
    for rel, meta in manifest.get("files", {}).items():
        check_file(step_dir, rel, meta)
    return manifest
