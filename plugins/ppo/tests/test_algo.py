"""Advantages and losses on worked examples computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from dlrover_plugin_ppo import algo
from dlrover_plugin_ppo.config import RLConfig
from dlrover_plugin_ppo.experience import compute_advantages, minibatches


def test_gae_worked_example():
    # one row, 3 steps, the episode ends after step 2; gamma 0.9, lambda 0.5
    r = torch.tensor([[1.0, 0.0, 2.0]])
    v = torch.tensor([[0.5, 1.0, 1.5]])
    d = torch.tensor([[0.0, 0.0, 1.0]])
    adv, ret = algo.gae(r, v, d, torch.tensor([9.0]), gamma=0.9, lam=0.5)
    # deltas: t2 = 2 - 1.5 = 0.5 (terminal: the 9.0 bootstrap is ignored)
    #         t1 = 0 + 0.9*1.5 - 1.0 = 0.35
    #         t0 = 1 + 0.9*1.0 - 0.5 = 1.4
    # A2 = 0.5; A1 = 0.35 + 0.45*0.5 = 0.575; A0 = 1.4 + 0.45*0.575 = 1.65875
    assert torch.allclose(adv, torch.tensor([[1.65875, 0.575, 0.5]]))
    assert torch.allclose(ret, adv + v)


def test_gae_bootstraps_unfinished_rows_and_lambda_one_is_discounted_return():
    r = torch.tensor([[1.0, 1.0]])
    v = torch.zeros(1, 2)
    adv, _ = algo.gae(r, v, torch.zeros(1, 2), torch.tensor([10.0]), gamma=0.5, lam=1.0)
    # reward-to-go with bootstrap: A1 = 1 + 0.5*10 = 6, A0 = 1 + 0.5*6 = 4
    assert torch.allclose(adv, torch.tensor([[4.0, 6.0]]))
    with pytest.raises(ValueError, match="last_values has shape"):
        algo.gae(r, v, torch.zeros(1, 2), torch.zeros(2), 0.9, 0.9)


def test_grpo_group_advantages_worked_example():
    # two prompts (ids 7 and 3), four samples each, interleaved on purpose
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])
    adv = algo.group_advantages(scores, groups)
    # group 7: mean 0.5, population std 0.5 -> +-1; group 3: all equal -> 0
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0, 0]), atol=1e-5)
    scores = torch.tensor([3.0, 0.0, 0.0])
    adv = algo.group_advantages(scores, torch.tensor([1, 1, 1]))
    # mean 1, std sqrt(((2)^2 + 1 + 1) / 3) = sqrt(2)
    assert torch.allclose(adv, torch.tensor([2.0, -1.0, -1.0]) / math.sqrt(2), atol=1e-5)


def test_grpo_advantages_in_a_batch_are_broadcast_over_real_tokens():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    batch = {"actions": torch.zeros(2, 3, dtype=torch.long), "logprobs": torch.zeros(2, 3),
             "mask": mask, "rewards": torch.zeros(2, 3),
             "dones": torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
             "group": torch.tensor([5, 5])}
    out = compute_advantages(batch, RLConfig.defaults("grpo"),
                             scores={"scores": torch.tensor([1.0, 0.0])})
    assert torch.allclose(out["advantages"], torch.tensor([[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]),
                          atol=1e-5)
    assert "returns" not in out


def test_ppo_advantages_put_score_on_last_token_and_kl_in_reward():
    rl = RLConfig(gamma=1.0, lam=1.0, kl_coef=0.5, kl_mode="reward", normalize_advantages=False)
    batch = {"actions": torch.zeros(1, 3, dtype=torch.long),
             "logprobs": torch.tensor([[-1.0, -1.0, -1.0]]),
             "mask": torch.tensor([[1.0, 1.0, 0.0]]), "rewards": torch.zeros(1, 3),
             "dones": torch.tensor([[0.0, 1.0, 0.0]])}
    out = compute_advantages(batch, rl, scores={"scores": torch.tensor([2.0])},
                             ref={"ref_logprobs": torch.tensor([[-2.0, -1.0, -5.0]])},
                             values={"values": torch.zeros(1, 3), "last_values": torch.zeros(1)})
    # rewards: t0 = -0.5 * (-1 - -2) = -0.5; t1 = 2 (score) - 0 = 2; t2 padding = 0
    assert torch.allclose(out["advantages"], torch.tensor([[1.5, 2.0, 0.0]]))
    assert torch.allclose(out["returns"][:, :2], torch.tensor([[1.5, 2.0]]))


def test_time_limit_bootstrap_is_added_to_the_reward():
    rl = RLConfig(gamma=0.5, lam=1.0, normalize_advantages=False)
    batch = {"actions": torch.zeros(1, 1, dtype=torch.long), "logprobs": torch.zeros(1, 1),
             "mask": torch.ones(1, 1), "rewards": torch.ones(1, 1), "dones": torch.ones(1, 1)}
    out = compute_advantages(batch, rl, values={"values": torch.zeros(1, 1),
                                                "last_values": torch.zeros(1),
                                                "bootstrap": torch.tensor([[4.0]])})
    assert torch.allclose(out["advantages"], torch.tensor([[3.0]]))  # 1 + 0.5 * 4


def test_clipped_surrogate():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([[1.0, -1.0]])
    loss, st = algo.policy_loss(new, old, adv, None, clip_ratio=0.2)
    # step 0: min(1.5, 1.2) * 1 = 1.2; step 1: min(0.5 * -1, 0.8 * -1) = -0.8
    assert float(loss) == pytest.approx(-(1.2 - 0.8) / 2)
    assert float(st["clip_frac"]) == 1.0
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = algo.policy_loss(new, old, adv, mask, clip_ratio=0.2)
    assert float(loss) == pytest.approx(-1.2)


def test_value_clipping_and_kl():
    old = torch.tensor([[0.0]])
    ret = torch.tensor([[1.0]])
    v = torch.tensor([[2.0]])  # unclipped error 1; clipped V = 0.5 -> error 0.25; max = 1
    assert float(algo.value_loss(v, old, ret, None, 0.5)) == pytest.approx(0.5)
    v = torch.tensor([[0.9]])  # unclipped 0.01; clipped V = 0.5 -> 0.25: pessimistic max
    assert float(algo.value_loss(v, old, ret, None, 0.5)) == pytest.approx(0.125)
    assert float(algo.value_loss(v, old, ret, None, 0.0)) == pytest.approx(0.005)
    lp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    # k3 = r - log r - 1 with r = 0.25/0.5
    assert float(algo.kl_k3(lp, ref)) == pytest.approx(0.5 - math.log(0.5) - 1)
    assert float(algo.kl_k3(lp, lp)) == 0.0


def test_minibatches_cover_every_row_or_step_once():
    n, t = 6, 4
    mask = torch.ones(n, t)
    mask[0, 2:] = 0
    batch = {"mask": mask, "obs": torch.arange(n * t * 2.0).reshape(n, t, 2),
             "group": torch.arange(n)}
    rows = [mb["group"] for mb in minibatches(batch, 4, "row")]
    assert sorted(torch.cat(rows).tolist()) == list(range(n))
    steps = list(minibatches(batch, 4, "step"))
    assert all("group" not in mb and mb["obs"].shape[1:] == (1, 2) for mb in steps)
    seen = torch.cat([mb["obs"][:, 0, 0] for mb in steps])
    assert seen.numel() == int(mask.sum())  # the two padded steps are left out
