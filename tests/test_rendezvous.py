"""A role's rendezvous: rank 0's TCPStore server listens as soon as the master asks
for the port (``WorkloadHost.rendezvous_port``), before any rank's ``setup()``, so a
rank that joins before rank 0 connects at once instead of retrying after torch's
connect back-off; the group still forms whichever rank comes first. Real Ray actors,
real gloo groups (the ``fsdp`` backend's torch.distributed session)."""

from __future__ import annotations

import socket

import ray

from dlrover_core.runtime.context import WorkerContext
from dlrover_core.runtime.host import remote_workload_host


def _hosts(world_size: int) -> list:
    cls = remote_workload_host()
    return [cls.options(num_cpus=0).remote("tests.workloads:Echo", WorkerContext(
        job="rdzv", role="trainer", rank=r, world_size=world_size, local_rank=r,
        local_world_size=world_size, backend="fsdp", failover={"pg_timeout_s": 60}))
        for r in range(world_size)]


def test_rank0_listens_before_any_rank_joins_and_a_late_rank0_still_forms_the_group(
        ray_cluster):
    hosts = _hosts(2)
    try:
        ip = ray.get(hosts[0].node_info.remote(), timeout=60)["ip"]
        port = ray.get(hosts[0].rendezvous_port.remote(), timeout=60)
        # listening before any setup(): a plain TCP connect to the port succeeds
        socket.create_connection((ip, port), timeout=5).close()
        first = hosts[1].setup.remote(ip, port)  # rank 1 joins before rank 0
        assert not ray.wait([first], timeout=1.0)[0]  # it waits for rank 0 in the group
        ray.get([hosts[0].setup.remote(ip, port), first], timeout=60)
        assert ray.get([h.call.remote("rank_sum") for h in hosts], timeout=60) == [1.0, 1.0]
        # a second rendezvous of the same hosts (a re-setup in place) on a new port
        port2 = ray.get(hosts[0].rendezvous_port.remote(), timeout=60)
        assert port2 != port
        ray.get([h.setup.remote(ip, port2, 1) for h in reversed(hosts)], timeout=60)
        assert ray.get([h.call.remote("rank_sum") for h in hosts], timeout=60) == [1.0, 1.0]
    finally:
        for h in hosts:
            ray.kill(h)
