"""The trainer of the guide-style RL example, written as seed 004 writes it: the
guide's constructor ``__init__(self, actor_handles, actor_classes, config)``, only
definitions there, preparation in ``init``, the loop in ``fit``, roles reached
through ``RG_<ROLE>`` role groups.
"""

from __future__ import annotations

import random

import ray

from dlrover_core import BaseTrainer


class UserTrainer(BaseTrainer):

    def __init__(self, actor_handles, actor_classes, config):
        super().__init__(actor_handles, actor_classes, config)

        # define your trainer property
        self.iterations = None
        self.batch_size = None
        self.rng = None

    def init(self):
        # preparation for training: the prompt sampler and every role's model
        self.iterations = int(self.config.iterations)
        self.batch_size = int(self.config.batch_size)
        self.rng = random.Random(self.config.seed)
        self.RG_ACTOR.init_model()
        self.RG_ROLLOUT.init_model()
        self.RG_REFERENCE.init_model()

    def fit(self):
        mean_reward = 0.0
        for it in range(self.iterations):
            weights = self.RG_ACTOR.get_weights()
            # the guide's per-instance handles: h.method.remote()
            ray.get([h.load_weights.remote(weights) for h in self.actor_handles["rollout"]])
            prompts = [self.rng.randrange(10) for _ in range(self.batch_size)]
            samples = self.RG_ROLLOUT.generate(prompts)                 # DRef, one shard per rank
            ref_logp = self.RG_REFERENCE.compute_ref_log_prob(samples)  # worker to worker
            rewards = self.RG_REWARD.compute_reward(samples)
            stats = self.RG_ACTOR.update_actor(samples, rewards, ref_logp)
            mean_reward = float(sum(r.sum() for r in rewards.get()) / self.batch_size)
            self.report(it, mean_reward=mean_reward, kl=stats["kl"], loss=stats["loss"])
        return {"mean_reward": mean_reward}
