"""Role-group data flow of the RL roles on real Ray actors: prompt ids auto-sharded over
rollout ranks keep their order, and rollout batches handed to the actor as DRefs
arrive merged in rank order."""

from __future__ import annotations

import pytest
import ray
import torch

from dlrover_core.runtime import DRef, RoleGroup
from dlrover_core.testing import spawn_role

CONFIG = {"rl_algorithm": "grpo", "rl": {"samples_per_prompt": 2},
          "toy": {"contexts": 5, "steps": 2}}


@pytest.fixture(scope="module")
def roles(ray_cluster):
    rollout = spawn_role("rollout", "dlrover_plugin_ppo.toy:ToyRollout", 4, CONFIG)
    actor = spawn_role("actor", "dlrover_plugin_ppo.toy:ToyActor", 2, CONFIG)
    yield RoleGroup("rollout", rollout), RoleGroup("actor", actor)
    for h in rollout + actor:
        ray.kill(h)


def test_prompt_ids_are_sharded_over_rollout_ranks_in_order(roles):
    rollout, actor = roles
    ids = list(range(100, 110))
    batch = rollout.generate.options(blocking=False)(0, ids)
    assert isinstance(batch, DRef) and len(batch) == 4
    # each rollout rank got one contiguous share, first ranks the larger ones
    assert rollout.prompts() == [[100, 101, 102], [103, 104, 105], [106, 107], [108, 109]]
    # the 4 batches go worker-to-worker to the 2 actor ranks: 2 each, merged in order
    adv = actor.compute_advantages(batch)
    groups = [a["group"].tolist() for a in adv]
    assert groups[0] == [100, 100, 101, 101, 102, 102, 103, 103, 104, 104, 105, 105]
    assert groups[1] == [106, 106, 107, 107, 108, 108, 109, 109]
    # contexts follow the prompt ids through the hand-off
    ctx = torch.cat([a["context"][:, 0] for a in adv])
    assert ctx.tolist() == [i % 5 for i in ids for _ in range(2)]
    # group-relative advantages: each group of 2 sums to 0
    a = torch.cat([x["advantages"][:, 0] for x in adv]).reshape(-1, 2)
    assert torch.allclose(a.sum(dim=1), torch.zeros(10), atol=1e-5)


def test_weights_go_from_actor_rank0_to_every_rollout_rank(roles):
    rollout, actor = roles
    versions = rollout.set_weights(actor.get_weights.options(blocking=False, target="RANK0")())
    assert len(versions) == 4 and len(set(versions)) == 1
    batch = rollout.generate.options(blocking=False)(1, list(range(8)))
    got = actor.compute_advantages(batch)
    assert all(int(v) == versions[0] for a in got for v in a["weights_version"])
