"""Scenario for test_flash_replica: a 2-node ``ray.cluster_utils.Cluster`` (plus a head
node), its own Ray in this process. Two ranks on node A save steps 1-3 with
``replicas: 1`` and ``persist_every_steps: 2`` (step 2 reaches the disk, step 3 only
memory); node A is removed; new ranks on the head node restore, then one rank on the
node that holds A's replicas (a smaller job) restores from them. Prints one JSON line.

    python plugins/flashckpt/tests/replica_scenario.py WORK_DIR
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid

import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dlrover_core.checkpoint.saver import committed_steps
from dlrover_core.master.client import init_ray
from dlrover_plugin_flashckpt import shm
from dlrover_plugin_flashckpt.persister import NAMESPACE, finish_job, persister_name

# run as a script: the repository's root on the path, so that the test workloads import
# as the Ray workers import them (their PYTHONPATH has the current directory, the root)
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))
from plugins.flashckpt.tests.flash_workloads import SaverRank  # noqa: E402


def main(work: str, transport: str = "tcp") -> None:
    temp_dir = tempfile.mkdtemp(prefix="dlrep", dir="/tmp")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "temp_dir": temp_dir, "include_dashboard": False})
    node_a = cluster.add_node(num_cpus=1, resources={"node_a": 4})
    node_b = cluster.add_node(num_cpus=1, resources={"node_b": 4})
    cluster.wait_for_nodes()
    init_ray(cluster.address)
    job = f"flashrep-{uuid.uuid4().hex[:6]}"
    ckpt = os.path.join(work, "ckpt")
    options = {"replicas": 1, "persist_every_steps": 2, "wait_timeout_s": 120,
               "replica_transport": transport}
    actor = ray.remote(SaverRank)
    out: dict = {"job": job, "node_a": node_a.node_id, "node_b": node_b.node_id}
    try:
        ranks = [actor.options(num_cpus=0, resources={"node_a": 1}).remote(
            job, ckpt, r, 2, options) for r in range(2)]
        out["saved_on"] = ray.get([a.node_id.remote() for a in ranks])
        for step in (1, 2, 3):
            ray.get([a.save.remote(step) for a in ranks])
        # step 2 is committed; step 3 waits in memory (not due) and in its replica
        deadline = time.time() + 180
        while time.time() < deadline and (committed_steps(ckpt) or [0])[-1] < 2:
            time.sleep(0.2)
        persister_a = ray.get_actor(persister_name(job, node_a.node_id), namespace=NAMESPACE)
        # one call that returns once both ranks' step 3 is replicated
        waited = ray.get(persister_a.wait_replica.remote("trainer", 3, 2, 180))
        out["waited"] = sorted((h["rank"], h["step"]) for h in waited)
        hist = ray.get(persister_a.replica_status.remote())["history"]
        out["replicas"] = [{k: h[k] for k in ("rank", "step", "peer", "bytes", "transport",
                                              "connect_s") if k in h}
                           for h in hist]
        out["committed_before"] = committed_steps(ckpt)
        cluster.remove_node(node_a)
        # the node's memory goes with it: on this one machine /dev/shm is shared by
        # every "node", so remove node A's slot buffers by hand (its replicas on B stay)
        slot = re.compile(r"-r\d{5}-s\d+$")
        removed = [p for p in shm.list_segments("/dev/shm", shm.job_prefix(job))
                   if slot.search(p)]
        for p in removed:
            os.unlink(p)
        out["removed_buffers"] = len(removed)
        head = ray.get_runtime_context().get_node_id()
        new = [actor.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            head, soft=False)).remote(job, ckpt, r, 2, options) for r in range(2)]
        out["restored_on"] = ray.get([a.node_id.remote() for a in new])
        out["loads"] = ray.get([a.load.remote() for a in new], timeout=300)
        out["committed_after"] = committed_steps(ckpt)
        # the job comes back smaller, on the node that holds the replicas (the next
        # node of the ring after A): one rank restores the 2-rank step 3 from the
        # replica buffers of its own node
        peer = [h["peer"] for h in hist if h["step"] == 3][0]
        one = actor.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            peer, soft=False)).remote(job, ckpt, 0, 1, options)
        out["smaller_on"] = ray.get(one.node_id.remote())
        out["smaller_load"] = ray.get(one.load.remote(), timeout=300)
    finally:
        try:
            finish_job(job, timeout=60)
        except Exception as exc:  # noqa: BLE001
            out["finish_error"] = str(exc)
        print(json.dumps(out))
        sys.stdout.flush()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        # finish_job keeps buffers newer than the newest commit (the replicas of step
        # 3 on node B): this test's own, removed here
        for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
            os.unlink(path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
