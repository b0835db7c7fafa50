"""Role-group data flow of the RL roles on real Ray actors: prompt ids auto-sharded over
rollout ranks keep their order, and rollout batches handed to the actor as DRefs
arrive merged in rank order."""

from __future__ import annotations

import pytest
import ray
import torch

from dlrover_core.runtime import DRef, RoleGroup
from dlrover_core.testing import spawn_role
from dlrover_plugin_ppo.trainer import push_weights, shares_weights

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


def test_push_weights_delivers_actor_rank0_weights_exactly(roles):
    """The sync path ``PPOTrainer.sync_weights`` runs: every rollout rank ends up with
    actor rank 0's values, bit for bit (rank 1 holds other values, so a copy from the
    wrong rank or a stale copy fails)."""
    rollout, actor = roles
    actor.perturb(11)
    sent = actor.get_weights.options(target="RANK0")()
    assert set(sent) == {"logits"}
    per_rank = actor.get_weights()  # this group has no decorators: every rank answers
    assert len(per_rank) == 2 and not torch.equal(per_rank[1]["logits"], sent["logits"])
    before = rollout.policy_state()
    assert not any(torch.equal(b["logits"], sent["logits"]) for b in before)
    versions = push_weights(actor, [rollout])
    assert len(versions) == 1 and len(versions[0]) == 4
    assert len(set(versions[0])) == 1  # every rank loaded it once more
    for got in rollout.policy_state():
        assert torch.equal(got["logits"], sent["logits"])
    actor.perturb(12)  # the actor trains on: the rollouts keep the values they loaded
    assert not torch.equal(actor.get_weights.options(target="RANK0")()["logits"],
                           sent["logits"])
    assert all(torch.equal(g["logits"], sent["logits"]) for g in rollout.policy_state())


W = "plugins.ppo.tests.weight_workloads"


def test_ranks_that_cannot_map_the_shared_weights_get_the_host_copy(ray_cluster):
    """``push_weights`` first offers the actor's shared weights (CUDA IPC handles on a
    GPU; this CPU machine has none, so the test actor sends a CPU state dict in their
    place); rollout rank 0 takes them, rank 1 answers ``None`` as a rank on another GPU
    does, and only rank 1 is then sent ``get_weights``' host copy. Both end with actor
    rank 0's values, each loaded once."""
    actor_h = spawn_role("actor", f"{W}:SharingActor", 1, CONFIG)
    rollout_h = spawn_role("rollout", f"{W}:HalfSharedRollout", 2, CONFIG)
    try:
        actor, rollout = RoleGroup("actor", actor_h), RoleGroup("rollout", rollout_h)
        assert not shares_weights(actor)  # a CPU policy: PPOTrainer would not offer it
        actor.perturb(21)
        sent = actor.get_weights.options(target="RANK0")()
        assert push_weights(actor, [rollout]) == [[1, 1]]
        assert rollout.transport() == ["cuda_ipc", "host"]
        assert all(torch.equal(g["logits"], sent["logits"]) for g in rollout.policy_state())
        # without sharing, every rank gets the host copy
        actor.perturb(22)
        sent = actor.get_weights.options(target="RANK0")()
        assert push_weights(actor, [rollout], share=False) == [[2, 2]]
        assert rollout.transport() == ["host", "host"]
        assert all(torch.equal(g["logits"], sent["logits"]) for g in rollout.policy_state())
    finally:
        for h in actor_h + rollout_h:
            ray.kill(h)


def test_a_cpu_policy_is_not_shared():
    from dlrover_plugin_ppo.shared_weights import SharedWeights

    assert SharedWeights.export({"w": torch.zeros(3)}) is None
    assert SharedWeights.export({}) is None
    # handles from another node are never opened here
    assert not SharedWeights({}, "another-node", "GPU-x", 0, 0).openable()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_collocated_rollouts_load_the_weights_over_cuda_ipc(ray_cluster):
    """Actor and two rollout ranks on one GPU (a third of it each): the rollouts map the
    actor's tensors over CUDA IPC and copy them on the GPU; after the actor changes its
    weights the rollouts keep the copies they made; ``share=False`` sends the host copy."""
    actor_h = spawn_role("actor", f"{W}:CudaActor", 1, CONFIG, num_gpus=1 / 3)
    rollout_h = spawn_role("rollout", f"{W}:CudaRollout", 2, CONFIG, num_gpus=1 / 3)
    try:
        actor, rollout = RoleGroup("actor", actor_h), RoleGroup("rollout", rollout_h)
        assert shares_weights(actor)
        actor.perturb(31)
        want = actor.digest()[0]
        assert rollout.digest() != [want, want]
        assert push_weights(actor, [rollout]) == [[1, 1]]
        assert rollout.transport() == ["cuda_ipc", "cuda_ipc"]
        assert rollout.digest() == [want, want]
        actor.perturb(32)
        assert actor.digest()[0] != want and rollout.digest() == [want, want]
        want = actor.digest()[0]
        assert push_weights(actor, [rollout], share=False) == [[2, 2]]
        assert rollout.transport() == ["host", "host"]
        assert rollout.digest() == [want, want]
    finally:
        for h in actor_h + rollout_h:
            ray.kill(h)
