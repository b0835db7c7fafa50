"""The numerical core of PPO and GRPO: advantages and losses (torch, CPU or GPU).

Shapes follow the batch layout of :mod:`dlrover_plugin_ppo.batch`: ``N`` rows
(trajectories or sampled sequences) by ``T`` steps (time steps or response
tokens); ``mask`` (float32, ``[N, T]``) is 1 on real steps and 0 on padding. All
tensors are float32 unless said otherwise; log-probabilities are in nats.

References:
- GAE: J. Schulman, P. Moritz, S. Levine, M. Jordan, P. Abbeel, "High-Dimensional
  Continuous Control Using Generalized Advantage Estimation", ICLR 2016, eq. 16.
- PPO clipped surrogate and value clipping: J. Schulman, F. Wolski, P. Dhariwal,
  A. Radford, O. Klimov, "Proximal Policy Optimization Algorithms", 2017, eq. 7 and 9.
- GRPO: Z. Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning
  in Open Language Models", 2024, section 4.1 (outcome supervision, eq. 3 and 4).
- k3 KL estimator: J. Schulman, "Approximating KL Divergence", 2020.
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1 (all when ``mask`` is None).
    Returns a 0-d tensor; 0 when the mask is empty."""
    if mask is None:
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries (population std); masked-out
    entries become 0."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) / (var.sqrt() + eps)
    return out * mask if mask is not None else out


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor,
        last_values: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016, eq. 16).

    ``delta_t = r_t + gamma * V(s_{t+1}) * (1 - d_t) - V(s_t)`` and
    ``A_t = delta_t + gamma * lam * (1 - d_t) * A_{t+1}``, computed backwards; the
    value after the last step is ``last_values``. ``d_t = 1`` ends an episode after
    step ``t`` (no bootstrap across it); padding after the end of a row must have
    ``d`` = 1 at the row's last real step.

    Args:
        rewards, values, dones: ``[N, T]`` float32.
        last_values: ``[N]`` float32, ``V(s_T)`` of the state after step ``T - 1``.
        gamma: discount in (0, 1]. lam: lambda in [0, 1].
    Returns:
        ``(advantages, returns)``, both ``[N, T]``; ``returns = advantages + values``
        are the lambda-returns, the critic's regression target.
    """
    if rewards.shape != values.shape or rewards.shape != dones.shape:
        raise ValueError(f"gae: rewards {tuple(rewards.shape)}, values {tuple(values.shape)} "
                         f"and dones {tuple(dones.shape)} must have the same [N, T] shape")
    if last_values.shape != rewards.shape[:1]:
        raise ValueError(f"gae: last_values has shape {tuple(last_values.shape)}; "
                         f"expected [N] = {tuple(rewards.shape[:1])}")
    n, t_len = rewards.shape
    adv = torch.zeros_like(rewards)
    running = torch.zeros(n, dtype=rewards.dtype, device=rewards.device)
    next_value = last_values.to(rewards.dtype)
    for t in range(t_len - 1, -1, -1):
        nonterminal = 1.0 - dones[:, t]
        delta = rewards[:, t] + gamma * next_value * nonterminal - values[:, t]
        running = delta + gamma * lam * nonterminal * running
        adv[:, t] = running
        next_value = values[:, t]
    return adv, adv + values


def group_advantages(scores: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6
                     ) -> torch.Tensor:
    """GRPO outcome advantages (Shao et al., 2024, section 4.1.2).

    Each sample's reward is normalised within the group of samples of the same
    prompt: ``A_i = (r_i - mean(r_g)) / (std(r_g) + eps)`` with the population std
    of the group. A group whose rewards are all equal gets 0 (nothing to prefer).

    Args:
        scores: ``[N]`` float32 reward of each sample.
        groups: ``[N]`` int64 prompt id of each sample (any order, any group sizes).
    Returns:
        ``[N]`` float32 advantages; broadcast them over the sample's tokens.

    Example: rewards ``[1, 0, 0, 1]`` in one group -> mean 0.5, std 0.5 ->
    ``[1, -1, -1, 1]`` (up to ``eps``).
    """
    if scores.shape != groups.shape or scores.dim() != 1:
        raise ValueError(f"group_advantages: scores {tuple(scores.shape)} and groups "
                         f"{tuple(groups.shape)} must both be [N]")
    uniq, inv = torch.unique(groups, return_inverse=True)
    k = uniq.numel()
    count = torch.zeros(k, dtype=scores.dtype, device=scores.device).index_add_(
        0, inv, torch.ones_like(scores))
    mean = torch.zeros(k, dtype=scores.dtype, device=scores.device).index_add_(
        0, inv, scores) / count
    centered = scores - mean[inv]
    var = torch.zeros(k, dtype=scores.dtype, device=scores.device).index_add_(
        0, inv, centered ** 2) / count
    return centered / (var.sqrt()[inv] + eps)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-step estimate of ``KL(pi || pi_ref)`` from samples of ``pi``:
    ``exp(ref - lp) - (ref - lp) - 1`` (k3, Schulman 2020; used by Shao et al., 2024,
    eq. 4). Non-negative and unbiased. Shapes ``[N, T]`` in, ``[N, T]`` out."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor | None, clip_ratio: float
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al., 2017, eq. 7), to minimise:
    ``-mean(min(rho * A, clip(rho, 1 - eps, 1 + eps) * A))`` with
    ``rho = exp(logprobs - old_logprobs)``, a token-level masked mean.

    Returns ``(loss, stats)`` with ``stats``: ``clip_frac`` (share of steps where the
    clipped term was active) and ``approx_kl`` (``mean(old - new)``, nats), both 0-d.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio) * advantages
    loss = -masked_mean(torch.minimum(unclipped, clipped), mask)
    with torch.no_grad():
        clip_frac = masked_mean((torch.abs(ratio - 1.0) > clip_ratio).float(), mask)
        approx_kl = masked_mean(old_logprobs - logprobs, mask)
    return loss, {"clip_frac": clip_frac, "approx_kl": approx_kl}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor | None, value_clip: float) -> torch.Tensor:
    """Critic loss ``0.5 * mean(max((V - R)^2, (V_clip - R)^2))`` with
    ``V_clip = V_old + clip(V - V_old, -c, c)`` (the PPO value clipping of Schulman
    et al., 2017, as in their baselines); ``value_clip = 0`` gives the plain squared
    error. Shapes ``[N, T]``; returns a 0-d tensor."""
    err = (values - returns) ** 2
    if value_clip > 0:
        v_clip = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    return 0.5 * masked_mean(err, mask)


def last_step_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real step of each row of ``mask`` ``[N, T]`` -> ``[N]`` int64
    (0 for an empty row)."""
    t = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, t, torch.zeros_like(t)).max(dim=1).values
