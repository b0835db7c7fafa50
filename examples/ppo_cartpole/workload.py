"""PPO on gymnasium ``CartPole-v1`` with separate rollout, actor and critic roles.

- ``CartPoleRollout``: each rank steps ``envs_per_worker`` environments for
  ``steps_per_iter`` steps with its copy of the policy, and returns the segment as
  a batch of ``N = envs_per_worker`` rows by ``T = steps_per_iter`` steps
  (see :mod:`dlrover_plugin_ppo.experience`); environments carry on across
  iterations, so episodes span segments. They are the rollout's state
  (``state_objects``): checkpointed at each driver commit with the actor's and the
  critic's, so a restarted job steps on from the same episodes.
- ``CartPoleCritic``: ``V(s)``; bootstraps the end of each segment (``last_values``)
  and episodes cut by the 500-step time limit (``bootstrap``), so truncation is not
  treated as failure.
- ``CartPoleActor``: the policy and its optimizer; the PPO update is the plugin's.

Settings under ``config.cartpole``: ``envs_per_worker`` (8), ``steps_per_iter`` (128),
``hidden`` (64), ``lr`` (actor, 1e-3), ``critic_lr`` (1e-3).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dlrover_plugin_ppo.workloads import (
    ActorWorkload,
    CriticWorkload,
    PickledState,
    RolloutWorkload,
    TorchRNG,
)
from examples.ppo_cartpole.model import OBS_DIM, Policy, Value

ENV_ID = "CartPole-v1"


def _settings(config: Any) -> dict:
    c = dict(config.get("cartpole", {}) or {})
    return {"envs_per_worker": int(c.get("envs_per_worker", 8)),
            "steps_per_iter": int(c.get("steps_per_iter", 128)),
            "hidden": int(c.get("hidden", 64)), "lr": float(c.get("lr", 1e-3)),
            "critic_lr": float(c.get("critic_lr", 1e-3))}


class CartPoleRollout(RolloutWorkload):
    def setup(self) -> None:
        import gymnasium as gym

        self.s = _settings(self.config)
        seed = self.init_torch()
        self.policy = Policy(self.s["hidden"])
        self.policy.eval()
        self.envs = [gym.make(ENV_ID) for _ in range(self.s["envs_per_worker"])]
        self.obs = np.stack([env.reset(seed=seed * 100 + i)[0]
                             for i, env in enumerate(self.envs)]).astype(np.float32)
        self.ep_return = np.zeros(len(self.envs))
        self.finished: list[float] = []
        self.num_env_steps = 0

    def state_objects(self) -> dict[str, Any]:
        """The environments (mid-episode), their observations and running returns, and
        the RNG that samples actions: checkpointed at each driver commit, so that a
        restored rollout steps the same episodes on."""
        return {"envs": PickledState(self, ["envs", "obs", "ep_return", "finished",
                                            "num_env_steps"]),
                "rng": TorchRNG()}

    @torch.no_grad()
    def generate(self, iteration: int, prompt_ids: Any = None) -> dict[str, torch.Tensor]:
        """``steps_per_iter`` steps of every environment. Returns ``obs`` ``[E, T, 4]``,
        ``actions`` ``[E, T]`` int64, ``logprobs``/``rewards``/``dones``/``mask``
        ``[E, T]``, ``final_obs`` ``[E, T, 4]`` and ``truncated`` ``[E, T]`` (time-limit
        ends), ``last_obs`` ``[E, 4]`` (the state after the segment)."""
        e, t_len = len(self.envs), self.s["steps_per_iter"]
        obs = np.zeros((e, t_len, OBS_DIM), np.float32)
        final_obs = np.zeros((e, t_len, OBS_DIM), np.float32)
        actions = np.zeros((e, t_len), np.int64)
        logprobs = np.zeros((e, t_len), np.float32)
        rewards = np.zeros((e, t_len), np.float32)
        dones = np.zeros((e, t_len), np.float32)
        truncated = np.zeros((e, t_len), np.float32)
        for t in range(t_len):
            obs[:, t] = self.obs
            d = self.policy.dist(torch.from_numpy(self.obs))
            a = d.sample()
            logprobs[:, t] = d.log_prob(a).numpy()
            a = a.numpy()
            actions[:, t] = a
            for i, env in enumerate(self.envs):
                ob, r, term, trunc, _ = env.step(int(a[i]))
                rewards[i, t] = r
                self.ep_return[i] += r
                if term or trunc:
                    dones[i, t] = 1.0
                    if trunc and not term:
                        truncated[i, t] = 1.0
                        final_obs[i, t] = ob
                    self.finished.append(float(self.ep_return[i]))
                    self.ep_return[i] = 0.0
                    ob, _ = env.reset()
                self.obs[i] = ob
        self.num_env_steps += e * t_len
        return {"obs": torch.from_numpy(obs), "actions": torch.from_numpy(actions),
                "logprobs": torch.from_numpy(logprobs), "rewards": torch.from_numpy(rewards),
                "dones": torch.from_numpy(dones), "mask": torch.ones(e, t_len),
                "final_obs": torch.from_numpy(final_obs),
                "truncated": torch.from_numpy(truncated),
                "last_obs": torch.from_numpy(self.obs.copy())}

    def stats(self) -> dict[str, Any]:
        """Returns of the episodes finished since the last call, and env steps."""
        out = {"episode_returns": self.finished, "num_env_steps": self.num_env_steps}
        self.finished, self.num_env_steps = [], 0
        return out


class CartPoleActor(ActorWorkload):
    def setup(self) -> None:
        self.s = _settings(self.config)
        self.init_torch()
        self.policy = Policy(self.s["hidden"])
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.s["lr"], eps=1e-5)

    def evaluate_actions(self, batch):
        d = self.policy.dist(batch["obs"])
        return d.log_prob(batch["actions"]), d.entropy()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean return of 5 greedy episodes (argmax action), on fresh seeds."""
        import gymnasium as gym

        env = gym.make(ENV_ID)
        total = []
        for k in range(5):
            ob, _ = env.reset(seed=10_000 + k)
            ret, done = 0.0, False
            while not done:
                a = int(self.policy.dist(torch.as_tensor(ob)).logits.argmax())
                ob, r, term, trunc, _ = env.step(a)
                ret += r
                done = term or trunc
            total.append(ret)
        return {"greedy_return": float(np.mean(total))}


class CartPoleCritic(CriticWorkload):
    def setup(self) -> None:
        self.s = _settings(self.config)
        self.init_torch()
        self.value_net = Value(self.s["hidden"])
        self.optimizer = torch.optim.Adam(self.value_net.parameters(), lr=self.s["critic_lr"],
                                          eps=1e-5)

    def predict(self, batch):
        return self.value_net(batch["obs"])

    @torch.no_grad()
    def values(self, batch):
        from dlrover_plugin_ppo.experience import as_batch

        b = as_batch(batch)
        return {"values": self.value_net(b["obs"]),
                "last_values": self.value_net(b["last_obs"]),
                "bootstrap": self.value_net(b["final_obs"]) * b["truncated"]}
