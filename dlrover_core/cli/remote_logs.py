"""The attempt logs of a job as every node of a Ray cluster sees them, for ``dlrover logs
--address``: a job directory that is not on a shared file system has each rank's
``logs/<role>-<rank>/attempt-<N>.log`` on the node the rank ran on.

One Ray task per alive node (``num_cpus=0``, a hard ``NodeAffinitySchedulingStrategy``)
reads the matching files under the same job-directory path on that node and returns
their bytes; the client merges them with its own copy. Works with a minimal ``ray``
install (no dashboard or state API needed) and with token authentication (the task
travels over the connection ``dlrover`` already made).
"""

from __future__ import annotations

import os
from typing import Callable

#: seconds to wait for each node's answer
NODE_TIMEOUT_S = 120.0


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` (``HOST:PORT``, or ``auto``: ``RAY_ADDRESS``
    or the one on this machine) with its token (:mod:`dlrover_core.master.ray_auth`),
    unless connected already. (Not ``master.client.init_ray``: that module imports the
    logs command, and the import graph stays acyclic.)

    Raises:
        ClusterAuthError: the cluster refused this process for want of a token.
        ConnectionError: no cluster answers at ``address``.
    """
    import ray

    from dlrover_core.master import ray_auth

    if ray.is_initialized():
        return
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
    if address != "auto":
        ray_auth.prepare_token_auth(address)
        ray_auth.check_token(address)
    else:
        ray_auth.quiet_token_auth(starting=False)
    try:
        ray.init(address=address, log_to_driver=False, include_dashboard=False,
                 logging_level="ERROR")
    except Exception as exc:
        if address != "auto" and ray_auth.is_auth_failure(exc):
            raise ray_auth.missing_token_error(address, exc) from exc
        raise


def read_cluster(reader: Callable[..., dict], *args: object,
                 timeout_s: float = NODE_TIMEOUT_S) -> tuple[dict, list[str]]:
    """``reader(*args)`` (``{key: bytes}``, e.g. the attempt logs under a job directory,
    :func:`dlrover_core.cli.logs.read_local`) run on every alive node of the connected
    Ray cluster, merged: for each key the longest copy (a shared file system gives every
    node the same bytes; without one, only the rank's node has them).

    Returns:
        ``({key: (bytes, node_id)}, problems)``: ``node_id`` is the hex id of a node
        that holds the longest copy; ``problems`` names nodes that did not answer.

    Raises:
        RuntimeError: this process is not connected to Ray.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("read_cluster: not connected to a Ray cluster")
    task = ray.remote(num_cpus=0, max_retries=0)(reader)
    pending = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        ref = task.options(scheduling_strategy=strategy).remote(*args)
        pending[ref] = node["NodeID"]
    merged: dict = {}
    problems = []
    for ref, node_id in pending.items():
        try:
            found: dict = ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a node lost or slow: say so, go on
            problems.append(f"node {node_id[:12]}: {type(exc).__name__}: {exc}"[:300])
            ray.cancel(ref, force=True)
            continue
        for key, data in found.items():
            if key not in merged or len(data) > len(merged[key][0]):
                merged[key] = (data, node_id)
    return merged, problems
