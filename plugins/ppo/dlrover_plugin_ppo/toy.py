"""A toy problem with all five roles, small enough for tests and for reading.

"Match the context": a prompt id ``p`` has context ``c = p % contexts``; at each of
``steps`` steps the policy picks one of ``actions`` actions, and the right one is
``(c + t) % actions``. The reward role scores a row by the fraction of right
actions (a rule, like a unit-test reward). The policy is a table of logits
``[contexts, steps, actions]``; the critic a table of values ``[contexts, steps]``.
A learner should go from ``reward_mean`` = 1/actions to near 1 in a few iterations.

Settings under ``config.toy``: ``contexts`` (4), ``steps`` (3), ``actions`` (4),
``rows`` (16: rows per rollout rank when the driver hands out no prompt ids), ``lr``
(0.2, Adam), ``hang_at`` / ``hang_rank`` (a test's fault: rollout rank ``hang_rank``'s
first attempt sleeps for an hour in ``generate`` of iteration ``hang_at``), and
``trace_dir``: when set, each rollout batch and each weights message carries
a tracer that appends ``<tag> <pid>`` to ``<trace_dir>/trace.log`` in every process
that deserialises it, so a test can check which processes the data went through.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dlrover_core.runtime.trace import Tracer
from dlrover_plugin_ppo.workloads import (
    ActorWorkload,
    CriticWorkload,
    ReferenceWorkload,
    RewardWorkload,
    RolloutWorkload,
    TorchRNG,
    cpu_state_dict,
)

TRACE_KEY = "__trace__"


class TablePolicy(torch.nn.Module):
    """Logits ``[contexts, steps, actions]``, zero-initialised (uniform policy)."""

    def __init__(self, contexts: int, steps: int, actions: int) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(contexts, steps, actions))

    def dist(self, context: torch.Tensor, step: torch.Tensor) -> torch.distributions.Categorical:
        """``context``, ``step``: ``[n, t]`` int64 -> a Categorical over actions ``[n, t]``."""
        return torch.distributions.Categorical(logits=self.logits[context, step])


class _Toy:
    def toy_setup(self) -> None:
        c = self.config.get("toy", {}) or {}
        self.contexts = int(c.get("contexts", 4))
        self.steps = int(c.get("steps", 3))
        self.actions = int(c.get("actions", 4))
        self.rows = int(c.get("rows", 16))
        self.lr = float(c.get("lr", 0.2))
        trace_dir = c.get("trace_dir")
        self.trace_path = os.path.join(trace_dir, "trace.log") if trace_dir else None
        self.init_torch()

    def target(self, context: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        return (context + step) % self.actions


class ToyActor(_Toy, ActorWorkload):
    def setup(self) -> None:
        self.toy_setup()
        self.policy = TablePolicy(self.contexts, self.steps, self.actions)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.lr)

    def evaluate_actions(self, batch):
        d = self.policy.dist(batch["context"], batch["step"])
        return d.log_prob(batch["actions"]), d.entropy()

    def get_weights(self):
        w: dict[str, Any] = cpu_state_dict(self.policy)
        if self.trace_path:
            w[TRACE_KEY] = Tracer(self.trace_path, "weights")
        return w

    @torch.no_grad()
    def perturb(self, seed: int) -> None:
        """Random logits from ``seed + rank`` (for tests of the weight sync)."""
        g = torch.Generator().manual_seed(seed + self.rank)
        self.policy.logits.copy_(torch.randn(self.policy.logits.shape, generator=g))

    def evaluate(self):
        """Greedy accuracy over every (context, step)."""
        ctx = torch.arange(self.contexts)[:, None].expand(-1, self.steps)
        step = torch.arange(self.steps)[None, :].expand(self.contexts, -1)
        greedy = self.policy.logits.argmax(-1)
        return {"accuracy": float((greedy == self.target(ctx, step)).float().mean())}


class ToyRollout(_Toy, RolloutWorkload):
    def setup(self) -> None:
        self.toy_setup()
        self.policy = TablePolicy(self.contexts, self.steps, self.actions)
        self.num_rows = 0
        self.seen_prompts: list[int] = []

    def state_objects(self):
        """The RNG that samples actions (a restored rollout samples what it would have)."""
        return {"rng": TorchRNG()}

    def set_weights(self, weights):
        if isinstance(weights, list):
            weights = weights[0]
        weights = {k: v for k, v in weights.items() if k != TRACE_KEY}
        return super().set_weights(weights)

    @torch.no_grad()
    def generate(self, iteration, prompt_ids=None):
        c = self.config.get("toy", {}) or {}
        if (c.get("hang_at") == iteration and int(c.get("hang_rank", 0)) == self.rank
                and self.attempt == 0):
            import time

            time.sleep(3600)  # a hung call (the master's hang bound ends it)
        if prompt_ids is None:
            g = torch.Generator().manual_seed(iteration * 1009 + self.rank)
            ids = torch.randint(0, 10_000, (self.rows,), generator=g)
        else:
            ids = torch.tensor(list(prompt_ids), dtype=torch.int64)
            self.seen_prompts.extend(int(i) for i in ids)
            ids = ids.repeat_interleave(self.rl.samples_per_prompt)
        n = ids.numel()
        context = (ids % self.contexts)[:, None].expand(n, self.steps).contiguous()
        step = torch.arange(self.steps)[None, :].expand(n, self.steps).contiguous()
        d = self.policy.dist(context, step)
        actions = d.sample()
        dones = torch.zeros(n, self.steps)
        dones[:, -1] = 1.0
        self.num_rows += n
        batch = {"group": ids, "context": context, "step": step, "actions": actions,
                 "logprobs": d.log_prob(actions), "mask": torch.ones(n, self.steps),
                 "rewards": torch.zeros(n, self.steps), "dones": dones,
                 "weights_version": torch.full((n,), self.weights_version)}
        if self.trace_path:
            batch["trace"] = Tracer(self.trace_path, f"batch-{self.rank}")
        return batch

    def stats(self):
        out = {"num_rows": self.num_rows}
        self.num_rows = 0
        return out

    def prompts(self) -> list[int]:
        """Every prompt id this rank was handed, in order (for tests)."""
        return list(self.seen_prompts)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """A copy of this rank's policy weights (for tests of the weight sync)."""
        return {k: v.clone() for k, v in self.policy.state_dict().items()}


class ToyReference(_Toy, ReferenceWorkload):
    def setup(self) -> None:
        self.toy_setup()
        self.policy = TablePolicy(self.contexts, self.steps, self.actions)

    def set_weights(self, weights):
        if isinstance(weights, list):
            weights = weights[0]
        return super().set_weights({k: v for k, v in weights.items() if k != TRACE_KEY})

    def evaluate_actions(self, batch):
        d = self.policy.dist(batch["context"], batch["step"])
        return d.log_prob(batch["actions"]), None


class ToyReward(_Toy, RewardWorkload):
    def setup(self) -> None:
        self.toy_setup()

    def reward(self, batch):
        right = batch["actions"] == self.target(batch["context"], batch["step"])
        return right.float().mean(dim=1)


class ToyCritic(_Toy, CriticWorkload):
    def setup(self) -> None:
        self.toy_setup()
        self.value_net = torch.nn.Module()
        self.value_net.table = torch.nn.Parameter(torch.zeros(self.contexts, self.steps))
        self.optimizer = torch.optim.Adam(self.value_net.parameters(), lr=self.lr)

    def predict(self, batch):
        return self.value_net.table[batch["context"], batch["step"]]
