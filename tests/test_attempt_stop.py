"""A survivor's attempt stopped where it computes (``dlrover_core.runtime.attempt_stop``):
after ``stop()`` (the master's ``abort_collectives``, when a peer of the rank failed) the
process's next module call, or the next gradient bucket of a DDP model under the ``ddp``
backend's communication hook, raises ``AttemptAborted``, once; no global hook exists in
a step without a failure, and ``clear()`` (a re-setup) forgets a stop.
In-process on real modules and autograd, and in a real ``WorkloadHost`` actor in a real
gloo group (world size 1, the ``fsdp`` backend's torch.distributed session) whose forward
loop runs while the abort comes on the actor's monitor thread, as in a recovery."""

from __future__ import annotations

import time

import pytest
import ray
import torch
from torch.nn.modules import module as nn_module

from dlrover_core.runtime import attempt_stop
from dlrover_core.runtime.context import WorkerContext
from dlrover_core.runtime.host import remote_workload_host


@pytest.fixture
def model():
    attempt_stop.clear()
    torch.manual_seed(0)
    yield torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    attempt_stop.clear()


def test_a_stop_during_backward_raises_at_the_next_gradient_bucket_before_any_update(
        model):
    """The ``ddp`` backend's communication hook (``CommWaitMeter.hook``) checks for a stop
    at each gradient bucket. DDP over a real gloo group of 1 in this process, buckets of
    one parameter each."""
    import socket

    import torch.distributed as dist

    from dlrover_core.tuning.comm_wait import CommWaitMeter

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-6)
        # the hook measure_comm_wait registers, on a meter of its own (the process's
        # COMM_WAIT, once active, adds step timings to every later step report here)
        ddp.register_comm_hook(ddp.process_group, CommWaitMeter().hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ddp(torch.ones(3, 4)).sum().backward()   # no stop: nothing happens
        opt.step()
        after_one = {k: v.clone() for k, v in model.state_dict().items()}
        assert any(not torch.equal(before[k], after_one[k]) for k in before)
        assert len(nn_module._global_forward_pre_hooks) == 0   # nothing armed in a step

        out = ddp(torch.ones(3, 4))
        # the stop comes while the backward runs (here: from the output's gradient hook)
        out.register_hook(lambda g: attempt_stop.stop("a peer of this rank failed"))
        with pytest.raises(attempt_stop.AttemptAborted, match="a gradient bucket"):
            out.sum().backward()
        assert not attempt_stop.pending()   # raised once
        assert len(nn_module._global_forward_pre_hooks) == 0
        assert all(torch.equal(after_one[k], v) for k, v in model.state_dict().items())
    finally:
        dist.destroy_process_group()


def test_a_stop_raises_at_the_next_module_call_and_clear_forgets_it(model):
    attempt_stop.stop("a peer of this rank failed")
    attempt_stop.stop("again")   # (one pending stop: the first reason)
    assert len(nn_module._global_forward_pre_hooks) == 1
    with pytest.raises(attempt_stop.AttemptAborted,
                       match="a peer of this rank failed: this attempt stopped at "
                             "Sequential's forward"):
        model(torch.ones(1, 4))
    assert len(nn_module._global_forward_pre_hooks) == 0
    model(torch.ones(1, 4))   # once
    attempt_stop.stop("a peer of this rank failed")
    attempt_stop.clear()
    assert not attempt_stop.pending() and len(nn_module._global_forward_pre_hooks) == 0
    model(torch.ones(1, 4))


def _setup(host, attempt: int = 0) -> None:
    ip = ray.get(host.node_info.remote(), timeout=60)["ip"]
    port = ray.get(host.rendezvous_port.remote(), timeout=60)
    ray.get(host.setup.remote(ip, port, attempt), timeout=60)


def test_the_master_s_abort_stops_a_rank_s_forward_loop_and_a_re_setup_clears_it(
        ray_cluster, tmp_path):
    host = remote_workload_host().options(num_cpus=0).remote(
        "tests.workloads:ForwardLoop", WorkerContext(
            job="fwdstop", role="trainer", rank=0, world_size=1, local_rank=0,
            local_world_size=1, backend="fsdp", failover={"pg_timeout_s": 60}))
    stop, started = str(tmp_path / "stop"), str(tmp_path / "started")
    try:
        _setup(host)
        assert ray.get(host.call.remote("global_hooks"), timeout=60) == 0   # no cost
        running = host.call.remote("forward_until", stop, started)
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ray.get(host.abort_collectives.remote(), timeout=30) == "skipped (gloo)"
        with pytest.raises(Exception, match="AttemptAborted"):
            ray.get(running, timeout=30)   # (the loop would run 60 s otherwise)
        assert ray.get(host.call.remote("global_hooks"), timeout=60) == 0   # fired once
        # armed while nothing runs (the survivor's collective had already failed): the
        # re-setup in place clears it before the new attempt's first forward
        ray.get(host.abort_collectives.remote(), timeout=30)
        assert ray.get(host.call.remote("global_hooks"), timeout=60) == 1
        _setup(host, attempt=1)
        assert ray.get(host.call.remote("global_hooks"), timeout=60) == 0
        (tmp_path / "stop").touch()
        assert ray.get(host.call.remote("forward_until", stop, started), timeout=60) == 1
    finally:
        ray.kill(host)
