"""The same math at any world size (issue 23): real gloo ranks under DDP, a fixed data
order, the global batch kept by gradient accumulation, the learning rate unchanged."""

from __future__ import annotations

import pytest

from dlrover_core.runtime.elastic import ElasticBatch, largest_world_size
from tests.elastic_math import run

B = 8  # per-rank batch at 2 ranks


def test_two_ranks_match_one_rank_with_twice_the_batch():
    two = run([(0, 2)], steps=50, global_batch=2 * B, micro=B)
    one = run([(0, 1)], steps=50, global_batch=2 * B, micro=2 * B)
    accum = run([(0, 1)], steps=50, global_batch=2 * B, micro=B)  # 2 micro-batches
    assert len(two) == len(one) == len(accum) == 50
    assert two[-1] < two[0] * 0.7  # it trains
    for step, (a, b, c) in enumerate(zip(two, one, accum)):
        assert abs(a - b) <= 1e-5, (step, a, b)
        assert abs(a - c) <= 1e-5, (step, a, c)
    # a wrong scaling (no division by the accumulation count) is caught at this tolerance
    assert ElasticBatch(2 * B, B, 1).grad_accum_steps == 2


def test_plan_covers_each_position_once():
    for world in (1, 2, 4):
        plan = ElasticBatch(16, 2, world)
        seen = sorted(i for r in range(world) for m in plan.micro_ranges(3, r) for i in m)
        assert seen == list(range(48, 64))
    with pytest.raises(ValueError, match="global batch 16 is not a multiple"):
        ElasticBatch(16, 3, 2)
    assert largest_world_size(16, 2, max_ranks=3) == 2
    assert largest_world_size(16, 2, max_ranks=8) == 8
    with pytest.raises(ValueError, match="no world size"):
        largest_world_size(6, 4, max_ranks=3)
