"""RoleGroup dispatch on real Ray actors: broadcast, RANK0, auto_shard order, timeouts,
pre/post functions, non-blocking DRefs and worker-to-worker hand-off."""

from __future__ import annotations

import time

import pytest
import ray

from dlrover_core.runtime import DRef, InvocationTimeout, RoleGroup, WorkloadError
from dlrover_core.runtime.invocation import DEFAULT_OPTIONS, remote_methods
from dlrover_core.runtime.role_group import shard_value
from dlrover_core.testing import spawn_role


@pytest.fixture(scope="module")
def groups(ray_cluster):
    a = spawn_role("alpha", "tests.workloads:Echo", 4)
    b = spawn_role("beta", "tests.workloads:Echo", 2)
    inv = ray.get(a[0].setup.remote("", 0))["invocations"]  # setup again: idempotent
    yield RoleGroup("alpha", a, inv), RoleGroup("beta", b, inv)
    for h in a + b:
        ray.kill(h)


def test_broadcast_all_ranks_in_order(groups):
    alpha, _ = groups
    out = alpha.whoami()
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert [o["env_rank"] for o in out] == ["0", "1", "2", "3"]
    assert len({o["pid"] for o in out}) == 4
    assert all(o["world_size"] == 4 and o["role"] == "alpha" for o in out)


def test_auto_shard_keeps_order(groups):
    alpha, _ = groups
    items = list(range(10))
    out = alpha.take(items)
    assert out == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [x for part in out for x in part] == items
    out = alpha.take_kw(items=list(range(8)), scale=3)  # kwargs shard too, scalars broadcast
    assert out == [[0, 3], [6, 9], [12, 15], [18, 21]]
    whole = alpha.take.options(auto_shard=False)([1, 2])
    assert whole == [[1, 2]] * 4


def test_auto_shard_tensor_and_errors():
    import torch

    parts = shard_value(torch.arange(10).reshape(5, 2), 2, "x")
    assert [p.shape[0] for p in parts] == [3, 2]
    assert torch.equal(torch.cat(parts), torch.arange(10).reshape(5, 2))
    with pytest.raises(ValueError, match="3 items cannot be split over 4 ranks"):
        shard_value([1, 2, 3], 4, "#0")


def test_rank0_target(groups):
    alpha, _ = groups
    assert alpha.only_rank0() == 0
    assert alpha.whoami.options(target="RANK0")()["rank"] == 0


def test_timeout(groups):
    alpha, _ = groups
    with pytest.raises(InvocationTimeout, match=r"alpha.slow: 4 of 4 ranks did not finish "
                                                r"within timeout=0.5 s"):
        alpha.slow.options(auto_shard=False)(2.0)
    assert alpha.slow.options(timeout=5, auto_shard=False)(0.1) == [0.1] * 4


def test_pre_and_post_func(groups):
    alpha, _ = groups
    assert alpha.incremented(4) == [10, 10, 10, 10]  # (4 + 1) * 2 on each rank


def test_non_blocking_returns_dref(groups):
    alpha, _ = groups
    ref = alpha.later.options(auto_shard=False)(3)
    assert isinstance(ref, DRef) and len(ref) == 4
    assert ref.wait(10)
    assert ref.get() == [30, 30, 30, 30]


def test_calls_to_one_actor_run_in_order(groups):
    _, beta = groups
    refs = [beta.record.options(blocking=False, auto_shard=False)(i) for i in range(20)]
    last = refs[-1].get()
    assert last[0][-20:] == list(range(20))


def test_dref_handoff_worker_to_worker(groups):
    alpha, beta = groups
    produced = alpha.produce.options(blocking=False, auto_shard=False)(3)  # 4 results
    # 4 results over 2 consumers: each gets 2 producers' results, concatenated, in order
    out = beta.consume(produced)
    assert out[0]["data"] == [0, 1, 2, 100, 101, 102]
    assert out[1]["data"] == [200, 201, 202, 300, 301, 302]
    # the whole DRef to every consumer
    out = beta.consume.options(auto_shard=False)(produced.concat())
    assert out[0]["data"] == out[1]["data"] and len(out[0]["data"]) == 12


def test_user_error_carries_traceback(groups):
    _, beta = groups
    with pytest.raises(WorkloadError) as e:
        beta.fail()
    err = e.value
    assert err.exc_type == "ValueError" and "boom from rank" in err.message
    assert "tests/workloads.py" in err.traceback and "in fail" in err.traceback


@pytest.mark.parametrize("method, why", [
    ("__setattr__", "private and dunder names"), ("__class__", "private and dunder names"),
    ("_private", "private and dunder names"), ("setup", "lifecycle methods"),
    ("doubled_rank", "not a method"), ("greeting", "not a method"),
    ("calls", "no such method"), ("missing", "no such method")])
def test_only_public_methods_are_callable(groups, method, why):
    alpha, _ = groups
    h = alpha.handles[0]
    with pytest.raises(WorkloadError) as e:
        ray.get(h.call.remote(method, "x"))
    assert e.value.exc_type == "AttributeError"
    assert f"Echo.{method}: not callable through a role group" in e.value.message
    assert why in e.value.message
    assert "allowed: the public methods of the workload: consume, fail," in e.value.message
    with pytest.raises(WorkloadError, match="not callable"):  # through the role group too
        alpha._invoke(method, DEFAULT_OPTIONS, (), {})
    # the workload was left alone: a dunder did not set anything
    assert ray.get(h.call.remote("whoami"))["rank"] == 0


def test_remote_methods_of_a_class():
    from tests.workloads import Echo

    names = remote_methods(Echo)
    assert "whoami" in names and "report" in names and "only_rank0" in names
    for absent in ("setup", "teardown", "warm_up", "doubled_rank", "greeting", "_private",
                   "__init__", "rank", "config", "checkpointer"):
        assert absent not in names


def test_activity_shows_the_running_call_and_its_stack(groups):
    alpha, _ = groups
    h = alpha.handles[2]
    assert ray.get(h.activity.remote())["busy"] is None
    ref = h.call.remote("slow", 3.0)
    deadline = time.time() + 30
    while (act := ray.get(h.activity.remote()))["busy"] is None:
        assert time.time() < deadline
        time.sleep(0.05)
    assert act["busy"] == "slow" and act["in_torch"] is False
    assert "tests/workloads.py" in act["stack"] and "in slow" in act["stack"]
    assert ray.get(ref) == 3.0
    assert ray.get(h.activity.remote())["busy"] is None
