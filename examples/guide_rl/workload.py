"""The roles of the guide-style RL example, written as seed 004 (DLRover's unified
API guide) writes them: ``@ray.remote`` classes with the guide's constructor
``__init__(self, master_handle, config)``, setup in ``init_model``, and
``@trainer_invocation`` options on the methods the trainer calls.

Roles: ``actor`` (the policy being trained), ``rollout`` (samples answers with the
actor's latest weights), ``reference`` (the frozen initial policy, for the KL
penalty), ``reward`` (the rule of :mod:`examples.guide_rl.task`).
"""

from __future__ import annotations

import ray
import torch

from dlrover_core import BaseWorkload, trainer_invocation
from examples.guide_rl.task import Policy, log_probs, rule_reward


def _initial_policy(seed: int) -> Policy:
    torch.manual_seed(seed)
    return Policy()


@ray.remote
class UserActorModel(BaseWorkload):

    def __init__(self, master_handle, config):
        super().__init__(master_handle, config)
        # define your actor property
        self.model = None
        self.optimizer = None
        self.version = 0

    @trainer_invocation(target="RANK0")
    def init_model(self):
        # preparation before training
        torch.set_num_threads(1)
        self.model = _initial_policy(self.config.seed)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.config.lr)
        return self.version

    @trainer_invocation(target="RANK0")
    def get_weights(self):
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    @trainer_invocation(target="RANK0", auto_shard=False)
    def update_actor(self, samples, rewards, ref_logp):
        # policy updating: REINFORCE with a per-prompt mean baseline and a k3 KL
        # penalty to the reference policy (Schulman, "Approximating KL divergence", 2020)
        samples, rewards, ref_logp = _cat(samples), _cat(rewards), _cat(ref_logp)
        prompts, answers = samples[:, 0], samples[:, 1]
        baseline = torch.zeros(10).index_add_(0, prompts, rewards) / torch.bincount(
            prompts, minlength=10).clamp(min=1)
        advantage = rewards - baseline[prompts]
        logp = log_probs(self.model, prompts, answers)
        log_ratio = ref_logp - logp
        kl = (log_ratio.exp() - 1 - log_ratio).mean()
        loss = -(advantage * logp).mean() + self.config.kl_coef * kl
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.version += 1
        return {"loss": float(loss), "kl": float(kl), "version": self.version}


@ray.remote
class UserRolloutModel(BaseWorkload):

    def __init__(self, master_handle, config):
        super().__init__(master_handle, config)
        self.model = None
        self.generator = None

    def init_model(self):
        torch.set_num_threads(1)
        self.model = _initial_policy(self.config.seed)
        self.generator = torch.Generator().manual_seed(self.config.seed + 1 + self.rank)

    def load_weights(self, weights):
        self.model.load_state_dict(weights)

    @trainer_invocation(blocking=False)
    def generate(self, prompts):
        # sample one answer per prompt; the result stays here as a DRef
        prompts = torch.as_tensor(prompts, dtype=torch.long)
        with torch.no_grad():
            probs = torch.softmax(self.model(prompts), dim=-1)
        answers = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        return torch.stack([prompts, answers], dim=1)


@ray.remote
class UserReferenceModel(BaseWorkload):

    def __init__(self, master_handle, config):
        super().__init__(master_handle, config)
        self.model = None

    def init_model(self):
        torch.set_num_threads(1)
        self.model = _initial_policy(self.config.seed).eval()

    @trainer_invocation(blocking=False)
    def compute_ref_log_prob(self, samples):
        samples = _cat(samples)
        with torch.no_grad():
            return log_probs(self.model, samples[:, 0], samples[:, 1])


@ray.remote
class UserRewardModel(BaseWorkload):

    def __init__(self, master_handle, config):
        super().__init__(master_handle, config)

    @trainer_invocation(blocking=False)
    def compute_reward(self, samples):
        samples = _cat(samples)
        return rule_reward(samples[:, 0], samples[:, 1], self.config.shift)


def _cat(value):
    """A DRef shard arrives as one tensor or a list of them (one per producing rank)."""
    if isinstance(value, (list, tuple)):
        return torch.cat([torch.as_tensor(v) for v in value])
    return torch.as_tensor(value)
