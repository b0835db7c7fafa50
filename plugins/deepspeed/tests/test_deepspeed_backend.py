"""The deepspeed backend on the CPU: 2 ranks over gloo train a model under ZeRO-2, and
the state-dict engine restores a snapshot bit for bit (real DeepSpeed, real actors)."""

from __future__ import annotations

import pytest
import torch

from dlrover_core.testing import assert_states_equal, call_all, kill_actors, spawn_role

pytest.importorskip("deepspeed")

WORKLOAD = "plugins.deepspeed.tests.ds_workloads:ZeroTrainer"


def test_zero2_trains_and_engine_state_round_trips(ray_cluster):
    hs = spawn_role("trainer", WORKLOAD, 2, {"stage": 2}, backend="deepspeed", job="dstest")
    try:
        losses = call_all(hs, "train", 30)
        for rank_losses in losses:
            assert sum(rank_losses[-5:]) < sum(rank_losses[:5]) * 0.7
        call_all(hs, "snapshot")
        before = call_all(hs, "flat_state")
        assert any(".optimizer.single_partition_of_fp32_groups" in k for k in before[0])
        # ZeRO-2 partitions the optimizer state: the ranks hold different halves
        key = ".optimizer.base_optimizer_state.state.0.exp_avg"
        assert not torch.equal(before[0][key], before[1][key])
        later = call_all(hs, "train", 3)
        call_all(hs, "restore")
        after = call_all(hs, "flat_state")
        assert_states_equal(after, before)
        assert call_all(hs, "train", 3) == later  # the same 3 steps again, bit for bit
    finally:
        kill_actors(hs)


def test_zero3_checkpoint_is_refused_with_the_stage(ray_cluster):
    """The README's promise: ZeRO-3 trains, but its checkpoint is refused, clearly."""
    from dlrover_core.runtime.errors import WorkloadError

    hs = spawn_role("trainer", WORKLOAD, 1, {"stage": 3}, backend="deepspeed", job="dstest3")
    try:
        assert len(call_all(hs, "train", 2)[0]) == 2
        with pytest.raises(WorkloadError) as e:
            call_all(hs, "snapshot")
        assert e.value.exc_type == "NotImplementedError"
        assert "ZeRO stage 3 is not supported" in e.value.message
        assert "use zero_optimization.stage 0, 1 or 2" in e.value.message
    finally:
        kill_actors(hs)


def test_engine_rejects_what_is_not_a_deepspeed_engine():
    from dlrover_plugin_deepspeed.engine import DeepSpeedEngineState

    with pytest.raises(TypeError, match="objects\\['model'\\] to be a DeepSpeedEngine.*Linear"):
        DeepSpeedEngineState().state_dict({"model": torch.nn.Linear(2, 2)})


def test_wrap_rejects_a_config_that_is_not_a_dict():
    from dlrover_core.runtime.context import WorkerContext
    from dlrover_plugin_deepspeed.backend import DeepSpeedSession

    session = DeepSpeedSession(WorkerContext(job="j", role="t", rank=0, world_size=1,
                                             local_rank=0, local_world_size=1))
    with pytest.raises(ValueError, match="config='ds.json'.*must be a dict"):
        session.wrap(torch.nn.Linear(2, 2), config="ds.json")
