"""Experience batches: the layout every role agrees on, merging, advantages, minibatches.

A batch is a ``dict[str, torch.Tensor]`` of ``N`` rows (environment trajectories
or sampled sequences) by ``T`` steps (time steps or response tokens). The
generating role (``rollout``, or ``actor`` when there is none) returns one batch
per rank with at least:

============  ==========  =======  =====================================================
key           shape       dtype    meaning
============  ==========  =======  =====================================================
actions       [N, T]      int64    action / token taken at step t
logprobs      [N, T]      float32  log pi_old(a_t | s_t) of the policy that sampled it (nats)
mask          [N, T]      float32  1 on real steps, 0 on padding after a row ends
rewards       [N, T]      float32  per-step environment reward (zeros for LLM outputs)
dones         [N, T]      float32  1 where an episode ends after step t (also at the
                                   last real step of a padded row)
group         [N]         int64    optional: prompt id of the row (GRPO groups)
============  ==========  =======  =====================================================

plus whatever the policy needs to recompute log-probabilities (``obs`` ``[N, T, ...]``,
``tokens`` ``[N, L]``...). Other roles answer with small dicts keyed the same way:

- reward ``score`` -> ``{"scores": [N]}``: outcome reward, added at each row's last real step;
- reference ``log_probs`` -> ``{"ref_logprobs": [N, T]}``;
- critic ``values`` -> ``{"values": [N, T], "last_values": [N]}`` (``V`` of the state
  after step ``T - 1``) and optionally ``"bootstrap": [N, T]``, the value of the final
  state where an episode was cut by a time limit (added as ``gamma * V`` to that step's
  reward, so truncation is not mistaken for termination).

Batches from several ranks are concatenated along rows (dim 0), in rank order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import torch

from dlrover_core.runtime.dref import merge
from dlrover_plugin_ppo import algo

if TYPE_CHECKING:
    from dlrover_plugin_ppo.config import RLConfig

REQUIRED = ("actions", "logprobs", "mask", "rewards", "dones")


def as_batch(value: Any) -> dict[str, Any] | None:
    """A batch from what a role call received: a dict as is, a list of per-rank dicts
    (a ``DRef`` consumed whole) concatenated along rows in rank order, ``None`` as is."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("an empty list of batches")
        if len(value) == 1:
            return value[0]
        return merge(list(value))
    raise TypeError(f"expected a batch dict or a list of them, got {type(value).__name__}")


def check_batch(batch: dict[str, Any], where: str = "batch") -> tuple[int, int]:
    """Check the required keys and shapes; returns ``(N, T)``.

    Raises:
        KeyError: a required key is missing (the message lists what is there).
        ValueError: a required tensor is not ``[N, T]``.
    """
    missing = [k for k in REQUIRED if k not in batch]
    if missing:
        raise KeyError(f"{where} lacks {', '.join(missing)}; it has {', '.join(sorted(batch))}"
                       f" (required: {', '.join(REQUIRED)})")
    shape = tuple(batch["mask"].shape)
    if len(shape) != 2:
        raise ValueError(f"{where}['mask'] has shape {shape}; expected [N, T]")
    for k in REQUIRED:
        if tuple(batch[k].shape) != shape:
            raise ValueError(f"{where}[{k!r}] has shape {tuple(batch[k].shape)}; "
                             f"expected [N, T] = {shape} like 'mask'")
    return shape  # type: ignore[return-value]


def compute_advantages(batch: dict[str, Any], rl: RLConfig, scores: dict | None = None,
                       ref: dict | None = None, values: dict | None = None) -> dict[str, Any]:
    """The batch plus ``advantages`` ``[N, T]`` (and ``returns``, ``values`` with a critic;
    ``ref_logprobs`` when the reference answered).

    Rewards: per-step ``rewards`` + ``scores`` at each row's last real step, minus
    ``kl_coef * (logprobs - ref_logprobs)`` per step when ``kl_mode`` is ``reward``,
    plus ``gamma * bootstrap`` where the critic gave time-limit bootstrap values.

    - With a critic: GAE (Schulman et al., 2016) over those rewards; ``returns`` are the
      critic's targets.
    - Without one, rows with a ``group`` id: GRPO (Shao et al., 2024): each row's summed
      reward is normalised within its group and broadcast over its real steps.
    - Without either: discounted reward-to-go (REINFORCE).

    With ``normalize_advantages`` the advantages are whitened over the real steps.
    """
    b = dict(batch)
    n, t_len = check_batch(b)
    mask = b["mask"].float()
    rewards = b["rewards"].float() * mask
    if scores is not None:
        s = scores["scores"].float().reshape(-1)
        if s.shape[0] != n:
            raise ValueError(f"reward role returned {s.shape[0]} scores for {n} rows")
        rewards = rewards.clone()
        rewards[torch.arange(n), algo.last_step_index(mask)] += s
        b["scores"] = s
    if ref is not None:
        ref_lp = ref["ref_logprobs"].float()
        if tuple(ref_lp.shape) != (n, t_len):
            raise ValueError(f"reference returned ref_logprobs of shape {tuple(ref_lp.shape)}; "
                             f"expected {(n, t_len)}")
        b["ref_logprobs"] = ref_lp
        if rl.kl_coef > 0 and rl.kl_mode == "reward":
            rewards = rewards - rl.kl_coef * (b["logprobs"].float() - ref_lp) * mask
    dones = b["dones"].float()
    if values is not None:
        v = values["values"].float()
        if tuple(v.shape) != (n, t_len):
            raise ValueError(f"critic returned values of shape {tuple(v.shape)}; "
                             f"expected {(n, t_len)}")
        last = values.get("last_values")
        last = torch.zeros(n) if last is None else last.float().reshape(n)
        if values.get("bootstrap") is not None:
            rewards = rewards + rl.gamma * values["bootstrap"].float() * mask
        adv, ret = algo.gae(rewards, v, dones, last, rl.gamma, rl.lam)
        b["values"], b["returns"] = v, ret
    elif "group" in b:
        adv = algo.group_advantages(rewards.sum(dim=1), b["group"].reshape(n))[:, None] * mask
    else:
        adv, _ = algo.gae(rewards, torch.zeros_like(rewards), dones, torch.zeros(n),
                          rl.gamma, 1.0)
    if rl.normalize_advantages:
        adv = algo.whiten(adv, mask)
    b["advantages"] = adv * mask
    return b


def minibatches(batch: dict[str, Any], count: int, unit: str = "row",
                generator: torch.Generator | None = None) -> Iterator[dict[str, Any]]:
    """Shuffle and split a batch into ``count`` minibatches.

    ``unit="row"``: whole rows; every tensor whose dim 0 is ``N`` is indexed.
    ``unit="step"``: the real steps (``mask`` = 1) of all rows, each becoming a row of
    length 1: tensors shaped ``[N, T, ...]`` become ``[B, 1, ...]``; row-only tensors
    (``[N]``) are dropped.
    """
    n, t_len = batch["mask"].shape
    if unit == "row":
        perm = torch.randperm(n, generator=generator)
        for part in torch.tensor_split(perm, min(count, n)):
            yield {k: v[part] for k, v in batch.items()
                   if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n}
        return
    if unit != "step":
        raise ValueError(f"minibatch unit {unit!r}; allowed: row, step")
    valid = torch.nonzero(batch["mask"].reshape(-1) > 0).reshape(-1)
    valid = valid[torch.randperm(valid.numel(), generator=generator)]
    flat = {k: v.reshape(n * t_len, 1, *v.shape[2:]) for k, v in batch.items()
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (n, t_len)}
    for part in torch.tensor_split(valid, min(count, max(1, valid.numel()))):
        yield {k: v[part] for k, v in flat.items()}
