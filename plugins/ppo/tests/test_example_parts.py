"""Pieces of the two examples that need no cluster: the arithmetic task and its reward
rule, the answer sampler's masks, and the CartPole rollout's time-limit bookkeeping."""

from __future__ import annotations

import torch

from examples.grpo_arith.policy import build_model, generate, response_logprobs
from examples.grpo_arith.task import (
    EOS,
    Problems,
    answer_text,
    encode,
    heldout,
    parse_answer,
    prompt_text,
    sft_batch,
)
from examples.grpo_arith.workload import ArithReward


def test_problems_are_text_and_heldout_is_never_trained_on():
    assert prompt_text(57, 8, 3) == "057+008=" and answer_text(57, 8, 3) == "0065."
    held = set(heldout(200, 2))
    assert len(held) == 200
    problems = Problems(2, 200, seed=3)
    assert all(problems.by_id(i) not in held for i in range(500))
    assert problems.by_id(11) == Problems(2, 200, seed=3).by_id(11)  # same in every process


def test_sft_targets_are_the_answer_characters_only():
    x, y = sft_batch([(57, 8)], 2)
    text = "57+08=065."
    assert x[0].tolist() == encode(text)[:-1]
    # the target of position i is character i + 1; only the answer "065." is learnt
    assert y[0].tolist() == [-100] * 5 + encode("065.")


def test_reward_rule_checks_the_sum():
    prompt = torch.tensor(encode("457+068="))
    assert ArithReward.check(prompt, torch.tensor(encode("0525."))) == 1.0
    assert ArithReward.check(prompt, torch.tensor(encode("525. "))) == 1.0  # value, not format
    assert ArithReward.check(prompt, torch.tensor(encode("0524."))) == 0.0
    assert ArithReward.check(prompt, torch.tensor(encode("05255"))) == 0.0  # never ended
    assert parse_answer(encode("..")) is None


def test_sampler_masks_stop_at_the_end_mark_and_logprobs_match_scoring():
    torch.manual_seed(0)
    model = build_model(2, 1, 2, 16)
    prompts = torch.tensor([encode("12+34=")] * 64)
    out = generate(model, prompts, 4)
    mask, actions = out["mask"], out["actions"]
    for row in range(64):
        n = int(mask[row].sum())
        ended = (actions[row, :n] == EOS).nonzero()
        # real tokens run up to and including the first '.', or fill the row
        assert (ended.numel() == 0 and n == 4) or int(ended[0]) == n - 1
        assert out["dones"][row, n - 1] == 1 and out["dones"][row].sum() == 1
    lp, _ = response_logprobs(model, prompts, actions)
    assert torch.allclose(lp * mask, out["logprobs"], atol=1e-5)


def test_cartpole_rollout_marks_time_limit_truncation():
    from gymnasium.wrappers import TimeLimit

    from dlrover_core.runtime.context import WorkerContext
    from examples.ppo_cartpole.workload import CartPoleRollout

    cfg = {"seed": 0, "cartpole": {"envs_per_worker": 2, "steps_per_iter": 300}}
    w = CartPoleRollout(WorkerContext(job="t", role="rollout", rank=0, world_size=1,
                                      local_rank=0, local_world_size=1, config=cfg))
    w.setup()
    # a 10-step time limit instead of 500, so that some episodes get cut
    w.envs = [TimeLimit(env.unwrapped, max_episode_steps=10) for env in w.envs]
    for i, env in enumerate(w.envs):
        w.obs[i] = env.reset(seed=i)[0]
    b = w.generate(0)
    assert b["obs"].shape == (2, 300, 4) and b["last_obs"].shape == (2, 4)
    trunc, dones = b["truncated"], b["dones"]
    assert trunc.sum() > 0 and dones.sum() > trunc.sum()  # both kinds of ends happen
    assert torch.all(dones[trunc > 0] == 1)  # a truncation also ends the episode
    # where truncated, final_obs holds the real last observation (non-zero), else zeros
    assert torch.all(b["final_obs"][trunc > 0].abs().sum(-1) > 0)
    assert torch.all(b["final_obs"][trunc == 0] == 0)
    returns = w.stats()["episode_returns"]
    assert len(returns) == int(dones.sum()) and max(returns) <= 10
