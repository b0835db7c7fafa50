"""Is a node's raylet still there? A direct TCP probe of its node-manager port.

When a machine (or every process of a node) is lost at once, Ray's GCS marks the node
dead only after its health checks fail (``health_check_period_ms`` x
``health_check_failure_threshold``: 3 s x 5 by default), while the owner of the
node's actors sees them die at once. In that window ``ray.nodes()`` still calls the
node alive, and a recovery that trusts it restarts the ranks in place, on a node that
is gone. A raylet whose port refuses a connection (or does not answer within
``timeout_s``) is treated as lost.
"""

from __future__ import annotations

import socket

import ray


def first_gone(node_ids: list[str], timeout_s: float = 1.0) -> str | None:
    """The first of ``node_ids`` whose raylet does not accept a TCP connection on its
    node-manager port (address and port from one ``ray.nodes()`` read), or ``None``. A
    node not in the table, or one Ray already marks dead, is gone."""
    if not node_ids:
        return None
    table = {n["NodeID"]: n for n in ray.nodes()}
    for node_id in node_ids:
        row = table.get(node_id)
        if row is None or not row.get("Alive"):
            return node_id
        try:
            socket.create_connection((row["NodeManagerAddress"], int(row["NodeManagerPort"])),
                                     timeout=timeout_s).close()
        except OSError:
            return node_id
    return None
