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
from dlrover_core.spec.values import plain, typed_value

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

    iterations: int = 100
    max_time_s: float = 0.0
    target_return: float | None = None
    return_window: int = 20
    prompts_per_iter: int = 0
    samples_per_prompt: int = 1
    evaluate: bool = False
    sync_reference: bool = True
    gamma: float = 0.99
    lam: float = 0.95
    normalize_advantages: bool = True
    clip_ratio: float = 0.2
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_mode: str = "reward"
    max_grad_norm: float = 0.5
    epochs: int = 4
    minibatches: int = 4
    minibatch_unit: str = "row"

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
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for k, v in section.items():
            if k not in fields:
                raise SpecError(f"{key}.{k}", v, "one of: " + ", ".join(fields),
                                "unknown RL setting")
            values[k] = _coerce(f"{key}.{k}", v, getattr(base, k), k)
        out = dataclasses.replace(base, **values)
        out.check(key, algorithm)
        return out

    def check(self, key: str = "config.rl", algorithm: str = "ppo") -> None:
        """Range checks. Raises :class:`SpecError`."""
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise SpecError(f"{key}.{name}", getattr(self, name), allowed)

        need("iterations", self.iterations >= 1, "an integer >= 1")
        need("max_time_s", self.max_time_s >= 0, "seconds >= 0 (0: no limit)")
        need("return_window", self.return_window >= 1, "an integer >= 1")
        need("prompts_per_iter", self.prompts_per_iter >= 0, "an integer >= 0")
        need("samples_per_prompt", self.samples_per_prompt >= 1, "an integer >= 1")
        need("gamma", 0.0 < self.gamma <= 1.0, "a number in (0, 1]")
        need("lam", 0.0 <= self.lam <= 1.0, "a number in [0, 1]")
        need("clip_ratio", 0.0 < self.clip_ratio < 1.0, "a number in (0, 1)")
        need("value_clip", self.value_clip >= 0.0, "a number >= 0 (0: no value clipping)")
        need("entropy_coef", self.entropy_coef >= 0.0, "a number >= 0")
        need("kl_coef", self.kl_coef >= 0.0, "a number >= 0")
        need("kl_mode", self.kl_mode in KL_MODES, ", ".join(KL_MODES))
        need("max_grad_norm", self.max_grad_norm >= 0.0, "a number >= 0 (0: no clipping)")
        need("epochs", self.epochs >= 1, "an integer >= 1")
        need("minibatches", self.minibatches >= 1, "an integer >= 1")
        need("minibatch_unit", self.minibatch_unit in MINIBATCH_UNITS, ", ".join(MINIBATCH_UNITS))
        if algorithm == "grpo":
            need("samples_per_prompt", self.samples_per_prompt >= 2,
                 "an integer >= 2 for grpo (advantages are relative to the group)")
        if self.target_return is not None:
            need("target_return", math.isfinite(self.target_return), "a finite number or null")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(key: str, value: Any, default: Any, name: str) -> Any:
    """``value`` converted to the type of the field's default; ``target_return`` may
    be null."""
    if name == "target_return":
        return None if value is None else typed_value(key, value, float)
    return typed_value(key, value, type(default))


__all__ = ["ALGORITHMS", "KL_MODES", "MINIBATCH_UNITS", "RLConfig"]
