"""Checkpoint locations given by URI (fsspec).

``checkpoint.dir`` may be a plain path, a ``file:///path`` URI (a local or NFS-like
mount: the local code path, renames are atomic) or a URI of any fsspec protocol that
is installed (``memory://`` is the one the tests use besides ``file://``; object stores
such as ``s3://`` need their fsspec package and are not tested here).

For a non-local URI the disk saver stages each step on local disk and uses
:class:`RemoteSteps`: every rank uploads its own files into ``<uri>/.step_<n>.tmp/``,
rank 0 writes ``manifest.json`` (sizes and sha256 read back from the store) there, then
moves the folder to ``<uri>/step_<n>`` and writes ``<uri>/latest``. A step counts as
committed only when its ``manifest.json`` is present under ``step_<n>`` (the commit
marker: on stores whose move is a copy, a half-moved step has no manifest yet because
the manifest is moved last). A load downloads the step into a local folder and
verifies it against its manifest before reading it.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import time
from typing import Any

from dlrover_core.checkpoint.manifest import MANIFEST
from dlrover_core.checkpoint.saver import STEP_DIR_RE, step_dir_name

_SCHEME_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def local_path(location: str) -> str | None:
    """The local path of ``location`` (a plain path, or ``file://`` + an absolute path);
    ``None`` for a URI of another protocol.

    Raises:
        ValueError: a ``file://`` URI whose path is not absolute (``file://host/...``).
    """
    m = _SCHEME_RE.match(location)
    if m is None:
        return location
    if m.group(1).lower() != "file":
        return None
    path = location[len(m.group(0)):]
    if not path.startswith("/"):
        raise ValueError(f"checkpoint.dir: {location!r}; a file:// URI needs an absolute "
                         "path (file:///mnt/ckpt)")
    return path


def filesystem(uri: str) -> tuple[Any, str]:
    """``(fsspec filesystem, path within it)`` of ``uri``.

    Raises:
        ValueError: the protocol is not known to fsspec or its package is missing (the
            message names the URI and the protocols fsspec knows).
    """
    import fsspec
    from fsspec.registry import known_implementations

    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ValueError, ImportError) as exc:
        raise ValueError(f"checkpoint.dir: {uri!r}: {exc}; fsspec protocols: "
                         f"{', '.join(sorted(known_implementations)[:40])}, ...") from exc
    return fs, path


def _sha256(fs: Any, path: str, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


class RemoteSteps:
    """The committed steps under ``uri`` (a non-local fsspec location)."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.fs, self.root = filesystem(uri)

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def tmp_name(self, step: int) -> str:
        return "." + step_dir_name(step) + ".tmp"

    def committed_steps(self) -> list[int]:
        """Steps whose ``step_<n>/manifest.json`` exists, oldest first."""
        try:
            names = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self.root,
                                                                          detail=False)]
        except FileNotFoundError:
            return []
        steps = []
        for name in names:
            m = STEP_DIR_RE.match(name)
            if m and self.fs.exists(self._path(name, MANIFEST)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def upload(self, local_dir: str, name: str) -> None:
        """Copy every file under ``local_dir`` to ``<uri>/<name>/`` (same relative paths)."""
        for root, _, files in os.walk(local_dir):
            for f in files:
                rel = os.path.relpath(os.path.join(root, f), local_dir)
                dst = self._path(name, *rel.split(os.sep))
                self.fs.makedirs(posixpath.dirname(dst), exist_ok=True)
                self.fs.put_file(os.path.join(root, f), dst)

    def clear(self, name: str) -> None:
        """Remove ``<uri>/<name>`` if present."""
        if self.fs.exists(self._path(name)):
            self.fs.rm(self._path(name), recursive=True)

    def commit(self, step: int, extra: dict) -> None:
        """Rank 0, after every rank uploaded: write the manifest of the staged step (sizes
        and sha256 read back from the store), move the step to ``step_<n>`` (manifest
        last) and write ``latest``."""
        import json

        tmp = self._path(self.tmp_name(step))
        files = {}
        for p in sorted(self.fs.find(tmp)):
            rel = posixpath.relpath(p, tmp)
            if rel != MANIFEST:
                files[rel] = {"bytes": int(self.fs.size(p)), "sha256": _sha256(self.fs, p)}
        manifest = {"step": step, "created": time.time(), "files": files, **extra}
        final = self._path(step_dir_name(step))
        self.clear(step_dir_name(step))  # a re-save after a restart from an older step
        for rel in files:
            self.fs.makedirs(posixpath.dirname(posixpath.join(final, rel)), exist_ok=True)
            self.fs.mv(posixpath.join(tmp, rel), posixpath.join(final, rel))
        self.fs.pipe_file(posixpath.join(final, MANIFEST), json.dumps(manifest).encode())
        self.clear(self.tmp_name(step))
        self.fs.pipe_file(self._path("latest"), f"{step}\n".encode())  # informational

    def download(self, step: int, local_dir: str) -> str:
        """Copy ``step_<n>`` into ``local_dir/step_<n>``; returns that folder."""
        src = self._path(step_dir_name(step))
        dst = os.path.join(local_dir, step_dir_name(step))
        for p in self.fs.find(src):
            target = os.path.join(dst, *posixpath.relpath(p, src).split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            self.fs.get_file(p, target)
        return dst

    def prune(self, keep: int, protect: int | None = None) -> list[int]:
        """Delete all but the newest ``keep`` committed steps, never ``protect``; the
        manifest goes first, so a half-deleted step is no longer committed."""
        steps = self.committed_steps()
        old = [s for s in (steps[:-keep] if keep > 0 else []) if s != protect]
        for s in old:
            self.fs.rm_file(self._path(step_dir_name(s), MANIFEST))
            self.clear(step_dir_name(s))
        return old

    def quarantine(self, step: int) -> None:
        """Take the damaged ``step`` out of the committed steps: its manifest is moved to
        ``manifest.json.corrupt`` (the files stay for inspection)."""
        path = self._path(step_dir_name(step), MANIFEST)
        if self.fs.exists(path):
            self.fs.mv(path, path + ".corrupt")
