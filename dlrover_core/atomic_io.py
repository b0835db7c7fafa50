"""Atomic, durable file writes for job state (``summary.json``, the driver's state):
write a temp file in the same directory, fsync it, rename it over the target, fsync
the directory. A crash leaves either the old file or the new one, never a torn one.

Checksummed payloads (:func:`write_checksummed` / :func:`read_checksummed`) carry a
sha256 line so that a reader can tell a complete file from a corrupt one.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


def fsync_dir(path: str) -> None:
    """fsync the directory ``path`` (makes a rename inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync dir."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(d)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented, key-sorted JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")


def write_checksummed(path: str, payload: bytes) -> None:
    """Write ``<sha256 hex>\\n<payload>`` to ``path`` atomically."""
    atomic_write_bytes(path, hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


def read_checksummed(path: str) -> bytes | None:
    """The payload :func:`write_checksummed` wrote, or ``None`` when ``path`` does not
    exist.

    Raises:
        ValueError: the sha256 line does not match the payload (a corrupt file),
            naming the path.
    """
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        digest, _, payload = f.read().partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError(f"{path}: sha256 of the payload does not match its header line "
                         "(a torn or corrupt file)")
    return payload
