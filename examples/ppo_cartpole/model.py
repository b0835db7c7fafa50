"""Small MLPs for CartPole: a policy over the 2 actions and a state-value function.

Shapes: ``obs`` ``[..., 4]`` float32 (cart position, cart velocity, pole angle, pole
angular velocity); the policy returns logits ``[..., 2]``, the value net ``[...]``.
Orthogonal initialisation with a small last layer for the policy, as is usual for
PPO (Andrychowicz et al., 2021, "What Matters in On-Policy Reinforcement Learning").
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

OBS_DIM = 4
N_ACTIONS = 2


def mlp(out_dim: int, hidden: int, last_gain: float) -> nn.Sequential:
    net = nn.Sequential(nn.Linear(OBS_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden),
                        nn.Tanh(), nn.Linear(hidden, out_dim))
    for i, m in enumerate(net):
        if isinstance(m, nn.Linear):
            gain = last_gain if i == len(net) - 1 else math.sqrt(2)
            nn.init.orthogonal_(m.weight, gain)
            nn.init.zeros_(m.bias)
    return net


class Policy(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = mlp(N_ACTIONS, hidden, 0.01)

    def dist(self, obs: torch.Tensor) -> torch.distributions.Categorical:
        """A Categorical over the 2 actions for each observation ``[..., 4]``."""
        return torch.distributions.Categorical(logits=self.net(obs))


class Value(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = mlp(1, hidden, 1.0)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).squeeze(-1)
