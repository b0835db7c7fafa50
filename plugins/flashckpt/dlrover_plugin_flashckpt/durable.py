"""Small durable file writes of the flash commit, each with its crash point: a file
written whole under a name of its own, ``fsync``ed, renamed into place; nothing of a
failed write is left behind. Imports no torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from typing import Any

from dlrover_core.atomic_io import fsync_dir
from dlrover_core.crashpoints import crashpoint
from dlrover_core.pids import pid_alive


def remove(path: str) -> None:
    """Remove the file or directory ``path``; a missing one is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def write_bytes(path: str, data: bytes, point: str) -> None:
    """Write ``data`` to ``path`` atomically (temp file, ``fsync``, rename, ``fsync`` of
    the directory); ``point``: the crash point of the write (hit after the bytes are
    written, before the ``fsync``). The temp file (``.<name>.<host>.<pid>.<random>.part``)
    is removed when anything fails; one a killed process left is removed by
    :func:`remove_dead_parts`.

    Raises:
        OSError: the write, ``fsync`` or rename failed (``ENOSPC``, ``EIO``).
    """
    d, name = os.path.split(path)
    part = os.path.join(d, f".{name}.{socket.gethostname()}.{os.getpid()}."
                           f"{os.urandom(4).hex()}.part")
    try:
        with open(part, "xb") as f:
            f.write(data)
            f.flush()
            crashpoint(point, path=path)
            os.fsync(f.fileno())
        os.replace(part, path)
    except BaseException:
        remove(part)
        raise
    fsync_dir(d)


def write_json(path: str, obj: Any, point: str) -> None:
    """:func:`write_bytes` of ``obj`` as indented, key-sorted JSON."""
    write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n").encode(),
                point)


def remove_dead_parts(directory: str, name: str) -> None:
    """Remove the temp files of :func:`write_bytes` for ``directory/name`` that a
    process of this host left when it was killed (its pid no longer runs)."""
    pat = re.compile(rf"^\.{re.escape(name)}\.{re.escape(socket.gethostname())}\.(\d+)\."
                     r"[0-9a-f]{8}\.part$")
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for n in names:
        m = pat.match(n)
        if m and not pid_alive(int(m.group(1))):
            remove(os.path.join(directory, n))
