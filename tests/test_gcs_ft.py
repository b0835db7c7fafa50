"""Head loss with Ray's GCS fault tolerance (``dlrover cluster up --gcs-ft``): a
``redis-server`` and a head started with ``RAY_REDIS_ADDRESS``; the head is SIGKILLed
whole and a new head started on the same port with the same Redis
(``local_cluster.restart_head``). A detached actor on the worker node lives through
it: the same process, its state kept, reachable by name through the new head.

What happens to a dlrover job then (its JobMaster pinned to the old head's node) is
in docs/clusters.md ("Head loss"); this test covers the Ray layer it stands on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dlrover_core.cli import local_cluster as lc

ACTOR = r'''
import os, sys
import ray
ray.init(address=sys.argv[1], namespace="gcsft", logging_level="ERROR")

@ray.remote(num_cpus=1)
class Counter:
    def __init__(self):
        self.n = 0

    def inc(self):
        self.n += 1
        return self.n, os.getpid(), ray.get_runtime_context().get_node_id()

if sys.argv[2] == "create":
    c = Counter.options(name="counter", lifetime="detached").remote()
else:
    c = ray.get_actor("counter")
n, pid, node = ray.get(c.inc.remote(), timeout=120)
print(n, pid, node)
'''


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_actor_on_a_worker_node_survives_a_head_restart(tmp_path):
    d = str(tmp_path / "cluster")
    state = lc.up(nodes=1, cpus_per_node=1, directory=d, gcs_ft=True)
    try:
        assert lc.pid_alive(state["redis"]["pid"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(lc.client_env(state))

        def call(mode: str) -> list[str]:
            out = subprocess.run([sys.executable, "-c", ACTOR, state["address"], mode],
                                 env=env, capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
            return out.stdout.split()

        n, pid, node = call("create")
        worker = next(x for x in state["nodes"] if not x["head"])
        assert n == "1" and node == worker["node_id"]
        old_head = next(x for x in state["nodes"] if x["head"])
        new_head = lc.restart_head(state)
        assert not lc.pid_alive(old_head["pid"]) and lc.pid_alive(new_head["pid"])
        assert new_head["node_id"] and new_head["node_id"] != old_head["node_id"]
        assert call("get") == ["2", pid, node]  # same process, state kept
    finally:
        lc.down(d)
    assert not lc.pid_alive(state["redis"]["pid"])
