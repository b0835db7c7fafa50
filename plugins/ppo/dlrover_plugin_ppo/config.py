"""The ``config.rl`` section of a ``ppo`` / ``grpo`` job: algorithm and loop settings.

Pure Python (no torch), so the template's ``apply`` can validate a spec in the
client before anything starts. Every workload and the driver see the same section
(the job ``config`` is handed to all of them) and read it with
:meth:`RLConfig.from_config`.

Example (YAML)::

    config:
      rl: {iterations: 200, gamma: 0.99, lam: 0.95, clip_ratio: 0.2, epochs: 4,
           target_return: 475}
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.fields import check_fields, read_fields, refuse_unknown, spec_field
from dlrover_core.spec.values import plain

ALGORITHMS = ("ppo", "grpo")
KL_MODES = ("reward", "loss")
MINIBATCH_UNITS = ("row", "step")


@dataclass(frozen=True)
class RLConfig:
    """Settings of the RL loop (all optional; defaults depend on the template).

    Loop (read by the driver):
        iterations: driver iterations at most (each: generate, score, advantages,
            update, weight sync). ``max_time_s``: stop after this many seconds of
            ``fit`` (0: no limit). ``target_return``: stop once the mean episodic
            return over the last ``return_window`` finished episodes reaches it
            (``None``: never). ``prompts_per_iter``: prompt ids the driver hands out per
            iteration, split over the rollout ranks in order (0: the rollout workers
            choose their own inputs, e.g. environments). ``evaluate``: call the
            actor's ``evaluate()`` before the first and after the last iteration
            and report ``<metric>_before`` / ``<metric>_after``. ``sync_reference``:
            load the actor's initial weights into the reference role.

    Advantages:
        gamma: discount factor in (0, 1]. lam: GAE lambda in [0, 1] (Schulman et al.,
            2016). samples_per_prompt: GRPO group size G (rows per prompt id).
        normalize_advantages: whiten advantages over the batch before the update.

    Losses (Schulman et al., 2017):
        clip_ratio: epsilon of the clipped surrogate, > 0. value_clip: clip range of
            the value update around the old values (0: unclipped). entropy_coef:
            entropy bonus weight >= 0. kl_coef: weight of KL(pi || pi_ref) >= 0;
            kl_mode ``reward`` subtracts ``kl_coef * (log pi - log pi_ref)`` from each
            step's reward (PPO-RLHF), ``loss`` adds ``kl_coef * k3`` to the loss
            (Shao et al., 2024, eq. 4). max_grad_norm: gradient clipping (0: off).

    Optimisation:
        epochs: passes over each batch. minibatches: minibatches per pass.
        minibatch_unit: ``row`` (whole trajectories / sequences) or ``step``
            (individual time steps, for per-step policies such as an MLP on CartPole).
    """

    iterations: int = spec_field(100, ge=1)
    max_time_s: float = spec_field(0.0, ge=0, unit="seconds", note="0: no limit")
    target_return: float | None = spec_field(
        None, valid=lambda v, _: math.isfinite(v), allowed="a finite number or null")
    return_window: int = spec_field(20, ge=1)
    prompts_per_iter: int = spec_field(0, ge=0)
    samples_per_prompt: int = spec_field(1, ge=1)
    evaluate: bool = False
    sync_reference: bool = True
    gamma: float = spec_field(0.99, gt=0, le=1)
    lam: float = spec_field(0.95, ge=0, le=1)
    normalize_advantages: bool = True
    clip_ratio: float = spec_field(0.2, gt=0, lt=1)
    value_clip: float = spec_field(0.2, ge=0, note="0: no value clipping")
    entropy_coef: float = spec_field(0.0, ge=0)
    kl_coef: float = spec_field(0.0, ge=0)
    kl_mode: str = spec_field("reward", choices=KL_MODES)
    max_grad_norm: float = spec_field(0.5, ge=0, note="0: no clipping")
    epochs: int = spec_field(4, ge=1)
    minibatches: int = spec_field(4, ge=1)
    minibatch_unit: str = spec_field("row", choices=MINIBATCH_UNITS)

    @classmethod
    def defaults(cls, algorithm: str) -> RLConfig:
        """Template defaults: GRPO puts the KL in the loss, samples 8 per prompt and
        does not re-whiten its already group-normalised advantages."""
        if algorithm not in ALGORITHMS:
            raise SpecError("template", algorithm, ", ".join(ALGORITHMS))
        if algorithm == "grpo":
            return cls(kl_mode="loss", samples_per_prompt=8, normalize_advantages=False,
                       value_clip=0.0, epochs=1, minibatches=1, gamma=1.0, lam=1.0)
        return cls()

    @classmethod
    def from_config(cls, config: Any, algorithm: str = "ppo", key: str = "config.rl") -> RLConfig:
        """Read and validate ``config.rl`` (a dict or ``DictConfig``; ``config`` may be
        the whole job config or ``None``).

        Raises:
            SpecError: an unknown key, a value of the wrong type or out of range; the
                message names ``config.rl.<key>``, the value and what is allowed.
        """
        section: Any = {}
        if config is not None:
            getter = getattr(config, "get", None)
            section = getter("rl", None) if getter is not None else None
            section = {} if section is None else section
        section = plain(section)
        if not isinstance(section, Mapping):
            raise SpecError(key, section, "a mapping of RL settings (see RLConfig)")
        base = cls.defaults(algorithm)
        refuse_unknown(section, [f.name for f in dataclasses.fields(cls)], key,
                       "unknown RL setting")
        out = dataclasses.replace(base, **read_fields(cls, section, key))
        out.check(key, algorithm)
        return out

    def check(self, key: str = "config.rl", algorithm: str = "ppo") -> None:
        """The fields' declared ranges and choices, and GRPO's group size. Raises
        :class:`SpecError`."""
        check_fields(self, RLConfig, key)
        if algorithm == "grpo" and self.samples_per_prompt < 2:
            raise SpecError(f"{key}.samples_per_prompt", self.samples_per_prompt,
                            "an integer >= 2 for grpo (advantages are relative to the group)")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


__all__ = ["ALGORITHMS", "KL_MODES", "MINIBATCH_UNITS", "RLConfig"]
