"""Base classes of the five RL roles: the methods the PPO/GRPO driver calls.

Subclass the ones your job uses and fill in the model-specific parts; the RL
mechanics (advantages, clipped updates, weight hand-off) are here. Batches follow
:mod:`dlrover_plugin_ppo.experience`. Arguments that the driver passes as ``DRef``
arrive already fetched worker-to-worker: a dict, or a list of per-rank dicts,
which :func:`~dlrover_plugin_ppo.experience.as_batch` concatenates.

=========  ===========================================  ===============================
role       you provide (in ``setup``)                   the driver calls
=========  ===========================================  ===============================
actor      ``self.policy``, ``self.optimizer``,          ``compute_advantages``, ``update``,
           ``evaluate_actions(batch)``                   ``get_weights``, ``evaluate``
rollout    ``self.policy``, ``generate(iteration,        ``generate_iteration`` (``generate``
           prompt_ids)``, ``stats()``                    then ``stats``), ``iteration_stats``,
                                                         ``set_weights``
reference  ``self.policy``, ``evaluate_actions``         ``log_probs``, ``set_weights``
reward     ``reward(batch) -> [N]``                      ``score``, ``stats``
critic     ``self.value_net``, ``self.optimizer``,       ``values``, ``update``
           ``predict(batch) -> [N, T]``
=========  ===========================================  ===============================

State (failover): a role whose :meth:`RLWorkload.state_objects` is not ``None`` (the actor
and the critic by default; a rollout that keeps environments across iterations, as in
``examples/ppo_cartpole``) is checkpointed with the job's saver at the driver's iteration
boundary (:meth:`RLWorkload.save_state`, step = iterations done) and restored to the
driver's last commit after a failure (:meth:`RLWorkload.restore_state`); see
``docs/ppo.md``, "Failover".
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dlrover_core import trainer_invocation
from dlrover_plugin_ppo import algo
from dlrover_plugin_ppo.experience import as_batch, check_batch, compute_advantages, minibatches
from dlrover_plugin_ppo.shared_weights import SharedWeights
from dlrover_plugin_ppo.rl_base import RLWorkload, _mean_stats
from dlrover_plugin_ppo.state import (  # noqa: F401 - re-exported (examples, tests)
    OptimizerState, PickledState, StateNotFound, TorchRNG, cpu_state_dict, unwrap)

class ActorWorkload(RLWorkload):
    """The policy being trained (required role).

    In ``setup`` set ``self.policy`` (``torch.nn.Module``, possibly wrapped by the
    role's backend) and ``self.optimizer``; implement :meth:`evaluate_actions`.
    Without a ``rollout`` role the actor also generates: implement ``generate`` as
    in :class:`RolloutWorkload`.
    """

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def state_objects(self) -> dict[str, Any] | None:
        """The policy, its optimizer and the RNG (minibatch shuffles)."""
        model = unwrap(self.policy)
        return {"policy": model, "optimizer": OptimizerState(model, self.optimizer),
                "rng": TorchRNG()}

    def evaluate_actions(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probabilities (nats) of ``batch["actions"]`` under ``self.policy`` and the
        policy's entropy at each step, both ``[n, t]`` float32 with gradients (entropy
        may be ``None`` when ``entropy_coef`` is 0). Override."""
        raise NotImplementedError(f"{type(self).__name__}.evaluate_actions(batch)")

    def compute_advantages(self, batch: Any, scores: Any = None, ref: Any = None,
                           values: Any = None) -> dict[str, Any]:
        """The batch with ``advantages`` (and ``returns``): see
        :func:`dlrover_plugin_ppo.experience.compute_advantages`. Its result stays on
        this worker; the driver hands it to ``update`` here and on the critic."""
        return compute_advantages(as_batch(batch), self.rl, as_batch(scores), as_batch(ref),
                                  as_batch(values))

    def update(self, batch: Any) -> dict[str, float]:
        """``rl.epochs`` passes of ``rl.minibatches`` minibatches of the PPO loss:
        clipped surrogate (Schulman et al., 2017) - ``entropy_coef`` * entropy
        + ``kl_coef`` * k3 KL to the reference (when ``kl_mode`` is ``loss``).

        Returns the means over minibatches of ``policy_loss``, ``entropy``,
        ``approx_kl``, ``clip_frac``, ``kl_ref`` (when the reference answered), and
        ``update_s`` (seconds)."""
        t0 = time.perf_counter()
        b = as_batch(batch)
        check_batch(b, "actor.update batch")
        if "advantages" not in b:
            raise KeyError("actor.update needs a batch from compute_advantages (no 'advantages')")
        rl = self.rl
        self.policy.train()
        acc: dict[str, list[float]] = {}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for _ in range(rl.epochs):
            for mb in minibatches(b, rl.minibatches, rl.minibatch_unit):
                logprobs, entropy = self.evaluate_actions(mb)
                mask = mb["mask"]
                loss, st = algo.policy_loss(logprobs, mb["logprobs"], mb["advantages"], mask,
                                            rl.clip_ratio)
                acc.setdefault("policy_loss", []).append(float(loss))
                if entropy is None and rl.entropy_coef > 0:
                    raise ValueError(
                        f"config.rl.entropy_coef={rl.entropy_coef} needs the entropy, but "
                        f"{type(self).__name__}.evaluate_actions returned None for it")
                if entropy is not None:
                    ent = algo.masked_mean(entropy, mask)
                    loss = loss - rl.entropy_coef * ent
                    acc.setdefault("entropy", []).append(float(ent))
                if "ref_logprobs" in mb:
                    kl = algo.masked_mean(algo.kl_k3(logprobs, mb["ref_logprobs"]), mask)
                    if rl.kl_mode == "loss" and rl.kl_coef > 0:
                        loss = loss + rl.kl_coef * kl
                    acc.setdefault("kl_ref", []).append(float(kl))
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if rl.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, rl.max_grad_norm)
                self.optimizer.step()
                for k, v in st.items():
                    acc.setdefault(k, []).append(float(v))
        out = _mean_stats(acc)
        out["update_s"] = time.perf_counter() - t0
        return out

    @trainer_invocation(target="RANK0")
    def get_weights(self) -> dict[str, torch.Tensor]:
        """The policy's state dict on the CPU (:func:`cpu_state_dict`), for
        ``set_weights`` of the rollout and reference roles (moved through the object
        store, never the driver)."""
        return cpu_state_dict(self.policy)

    @trainer_invocation(target="RANK0")
    def policy_device(self) -> str:
        """Where the policy's first parameter lives (``"cpu"``, ``"cuda:0"``; ``"cpu"``
        without parameters): the driver offers shared weights only for ``cuda``."""
        p = next(iter(unwrap(self.policy).parameters()), None)
        return "cpu" if p is None else str(p.device)

    @trainer_invocation(target="RANK0")
    def share_weights(self) -> SharedWeights | None:
        """The policy's state dict as CUDA IPC handles (:class:`SharedWeights`), for
        ``set_weights_shared`` of ranks on the same GPU; ``None`` when the policy is not
        on one CUDA device (then the sync uses :meth:`get_weights`). A subclass whose
        ``get_weights`` sends something other than the policy's state dict overrides
        this too, or returns ``None``."""
        return SharedWeights.export(unwrap(self.policy).state_dict())

    @trainer_invocation(target="RANK0")
    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation for ``rl.evaluate`` (scalars). Default: nothing."""
        return {}


class RolloutWorkload(RLWorkload):
    """Generates experience with a copy of the policy.

    In ``setup`` set ``self.policy``; implement :meth:`generate`.
    """

    policy: torch.nn.Module
    weights_version: int = 0

    def generate(self, iteration: int, prompt_ids: list[int] | None = None) -> dict[str, Any]:
        """One batch (see :mod:`dlrover_plugin_ppo.experience`). ``prompt_ids`` is this
        rank's contiguous share of the ids the driver handed out (``rl.prompts_per_iter``),
        or ``None`` when the rollout chooses its own inputs (environments). Override."""
        raise NotImplementedError(f"{type(self).__name__}.generate(iteration, prompt_ids)")

    def set_weights(self, weights: Any) -> int:
        """Load the actor's weights (a state dict). Returns the new weights version."""
        if isinstance(weights, list):  # a DRef consumed whole: one state dict per actor rank
            weights = weights[0]
        unwrap(self.policy).load_state_dict(weights)
        self.weights_version += 1
        self.weights_transport = "host"
        return self.weights_version

    def stats(self) -> dict[str, Any]:
        """Scalars since the last call; ``episode_returns`` (a list of finished episodes'
        returns) feeds the driver's ``mean_return``; counts named ``num_<x>`` add up to
        the driver's ``total_<x>``. Called once right after each ``generate`` (by
        :meth:`generate_iteration`), so a call's stats belong to its iteration. Default:
        nothing."""
        return {}


class ReferenceWorkload(RLWorkload):
    """The frozen initial policy. In ``setup`` set ``self.policy``; implement
    :meth:`evaluate_actions` (as the actor's, no gradients needed)."""

    policy: torch.nn.Module

    def evaluate_actions(self, batch: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError(f"{type(self).__name__}.evaluate_actions(batch)")

    @torch.no_grad()
    def log_probs(self, batch: Any) -> dict[str, torch.Tensor]:
        """``{"ref_logprobs": [N, T]}`` of the batch's actions under the reference."""
        self.policy.eval()
        logprobs, _ = self.evaluate_actions(as_batch(batch))
        return {"ref_logprobs": logprobs.detach().float()}

    def set_weights(self, weights: Any) -> int:
        if isinstance(weights, list):
            weights = weights[0]
        unwrap(self.policy).load_state_dict(weights)
        for p in self.policy.parameters():
            p.requires_grad_(False)
        self.weights_transport = "host"
        return 1


class RewardWorkload(RLWorkload):
    """A reward model or rule. Implement :meth:`reward`."""

    _acc: dict[str, list[float]] | None = None

    def reward(self, batch: dict[str, Any]) -> torch.Tensor:
        """``[N]`` float32 outcome reward of each row. Override."""
        raise NotImplementedError(f"{type(self).__name__}.reward(batch)")

    @torch.no_grad()
    def score(self, batch: Any) -> dict[str, torch.Tensor]:
        """``{"scores": [N]}``; remembers their mean for :meth:`stats`."""
        scores = self.reward(as_batch(batch)).detach().float().reshape(-1)
        if self._acc is None:
            self._acc = {}
        self._acc.setdefault("reward_mean", []).append(float(scores.mean()))
        return {"scores": scores}

    def stats(self) -> dict[str, Any]:
        """Means of the scores since the last call (``reward_mean``)."""
        out = _mean_stats(self._acc or {})
        self._acc = {}
        return out


class CriticWorkload(RLWorkload):
    """The value function. In ``setup`` set ``self.value_net`` and ``self.optimizer``;
    implement :meth:`predict`; override :meth:`values` to bootstrap truncated rows."""

    value_net: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def state_objects(self) -> dict[str, Any] | None:
        """The value net, its optimizer and the RNG (minibatch shuffles)."""
        model = unwrap(self.value_net)
        return {"value_net": model, "optimizer": OptimizerState(model, self.optimizer),
                "rng": TorchRNG()}

    def predict(self, batch: dict[str, Any]) -> torch.Tensor:
        """``V(s_t)`` ``[n, t]`` float32 with gradients. Override."""
        raise NotImplementedError(f"{type(self).__name__}.predict(batch)")

    @torch.no_grad()
    def values(self, batch: Any) -> dict[str, torch.Tensor]:
        """``{"values": [N, T], "last_values": [N]}``; the default ``last_values`` are 0
        (every row ends its episode). Override to add ``last_values`` / ``bootstrap``."""
        b = as_batch(batch)
        self.value_net.eval()
        v = self.predict(b).detach().float()
        return {"values": v, "last_values": torch.zeros(v.shape[0])}

    def update(self, batch: Any) -> dict[str, float]:
        """``rl.epochs`` x ``rl.minibatches`` steps of the (clipped) value loss towards
        the batch's ``returns``. Returns ``value_loss``, ``explained_variance`` (of the
        old values, before the update) and ``update_s``."""
        t0 = time.perf_counter()
        b = as_batch(batch)
        if "returns" not in b:
            raise KeyError("critic.update needs a batch from compute_advantages with a critic "
                           "(no 'returns')")
        rl = self.rl
        self.value_net.train()
        acc: dict[str, list[float]] = {}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for _ in range(rl.epochs):
            for mb in minibatches(b, rl.minibatches, rl.minibatch_unit):
                v = self.predict(mb)
                loss = algo.value_loss(v, mb["values"], mb["returns"], mb["mask"], rl.value_clip)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if rl.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(params, rl.max_grad_norm)
                self.optimizer.step()
                acc.setdefault("value_loss", []).append(float(loss))
        out = _mean_stats(acc)
        m = b["mask"]
        var_r = algo.masked_mean((b["returns"] - algo.masked_mean(b["returns"], m)) ** 2, m)
        var_e = algo.masked_mean((b["returns"] - b["values"]
                                  - algo.masked_mean(b["returns"] - b["values"], m)) ** 2, m)
        out["explained_variance"] = float(1 - var_e / var_r) if float(var_r) > 0 else 0.0
        out["update_s"] = time.perf_counter() - t0
        return out
