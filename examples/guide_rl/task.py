"""The task of the guide-style RL example: a contextual bandit over digits.

A prompt is a digit ``x`` in ``[0, 10)``; the policy answers a digit ``y``; the rule
reward is 1 when ``y == (x + shift) % 10`` else 0 (``shift`` from the config, 3 by
default). A uniform policy earns 0.1 on average; a solved one earns 1.0.
"""

from __future__ import annotations

import torch

N_DIGITS = 10


class Policy(torch.nn.Module):
    """Logits over the answer digit for each prompt digit: an embedding and a linear
    layer. ``forward(prompts: LongTensor[B]) -> FloatTensor[B, 10]``."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(N_DIGITS, hidden)
        self.head = torch.nn.Linear(hidden, N_DIGITS)

    def forward(self, prompts: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(prompts)))


def log_probs(policy: torch.nn.Module, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """``log pi(answer | prompt)`` per sample, FloatTensor[B]."""
    logp = torch.log_softmax(policy(prompts), dim=-1)
    return logp.gather(1, answers[:, None]).squeeze(1)


def rule_reward(prompts: torch.Tensor, answers: torch.Tensor, shift: int) -> torch.Tensor:
    """1.0 where ``answer == (prompt + shift) % 10``, else 0.0; FloatTensor[B]."""
    return (answers == (prompts + shift) % N_DIGITS).float()
