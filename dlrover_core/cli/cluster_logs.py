"""The ends of a local cluster node's logs, for the errors of
:mod:`dlrover_core.cli.local_cluster` (a node's temp dir, with its raylet's logs, goes
when the cluster is stopped)."""

from __future__ import annotations

import os

__all__ = ["node_tail", "tail"]


def tail(path: str, n: int = 15) -> str:
    """The last ``n`` lines of ``path`` ('' when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def node_tail(node: dict) -> str:
    """The end of a node's ``ray start`` log and its raylet's (why it never registered):
    ``node`` is a node record of the cluster state (``log``, ``temp_dir``)."""
    logs = os.path.join(node["temp_dir"], "session_latest", "logs")
    parts = [f"{node['log']}\n{tail(node['log'])}"]
    for path in (os.path.join(logs, "raylet.err"), os.path.join(logs, "raylet.out")):
        parts += [f"-- {path}:\n{t}" for t in [tail(path, 8)] if t.strip()]
    return "\n".join(parts)
