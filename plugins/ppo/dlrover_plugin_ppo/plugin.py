"""Entry point of the ``ppo`` plugin: the ``ppo`` and ``grpo`` graph templates.

Imports nothing heavy (no torch): the driver and the workload base classes are
named by import path and loaded only in the processes that run them.

``ppo``: ``actor`` (policy training, required), ``critic`` (value training,
required), ``rollout`` (generation / environment steps), ``reference`` (frozen
policy for the KL penalty), ``reward`` (reward model or rule). The driver
:class:`dlrover_plugin_ppo.trainer.PPOTrainer` runs, per iteration: generate,
score, reference log-probs, values, advantages (GAE), update critic, update actor,
sync weights actor -> rollout.

Failover (see docs/ppo.md): ``roles.<role>.config.failover`` is ``replace`` for rollout,
reward and reference (a failed rank is replaced while the driver keeps running and
retries its call) and ``rollback`` for actor and critic (the driver restarts and rolls
the stateful roles back to its last commit), unless the spec says otherwise.

``grpo``: the same without a critic; advantages are group-normalised rewards over
``samples_per_prompt`` samples of each prompt (Shao et al., 2024).
"""

from __future__ import annotations

from typing import Any

from dlrover_core import GraphTemplate, RoleTemplate, SpecError, hookimpl

DRIVER = "dlrover_plugin_ppo.trainer:PPOTrainer"

_ROLES = {
    "actor": "policy training (required): compute_advantages, update, get_weights",
    "rollout": "generation / environment steps with the current policy: generate, set_weights",
    "reference": "frozen initial policy for the KL penalty: log_probs, set_weights",
    "reward": "reward model or rule: score",
    "critic": "value training: values, update",
}


#: failover policy of each role unless ``roles.<role>.config.failover`` says otherwise:
#: stateless roles are replaced while the driver retries its call; the stateful ones
#: (their state checkpointed at each commit) roll back to the driver's last commit
FAILOVER_DEFAULTS = {"rollout": "replace", "reward": "replace", "reference": "replace",
                     "actor": "rollback", "critic": "rollback"}


def generator_role(roles: Any) -> str:
    """The role that generates: ``rollout`` when the job has one, else ``actor``."""
    return "rollout" if "rollout" in roles else "actor"


def handoffs(roles: Any) -> list[tuple[str, str]]:
    """``(producer, consumer)`` pairs of roles whose results move as ``DRef`` s in one
    iteration, in the order the driver makes them. ``roles`` is any container of
    role names."""
    gen = generator_role(roles)
    pairs = [(gen, "reward"), (gen, "reference"), (gen, "critic"), (gen, "actor"),
             ("reward", "actor"), ("reference", "actor"), ("critic", "actor"),
             ("actor", "critic")]
    return [(p, c) for p, c in pairs if p in roles and c in roles and p != c]


def _apply(algorithm: str, spec: Any) -> None:
    from omegaconf import OmegaConf

    from dlrover_plugin_ppo.config import RLConfig

    if spec.config is None or not OmegaConf.is_dict(spec.config):
        if spec.config not in (None, {}):
            raise SpecError("config", spec.config, "a mapping (the job config)")
        spec.config = {}
    rl = RLConfig.from_config(spec.config, algorithm)
    spec.config.rl = rl.as_dict()
    spec.config.rl_algorithm = algorithm
    roles = spec.roles
    from dlrover_core.graph.graph import set_failover_policies

    set_failover_policies(roles, FAILOVER_DEFAULTS, "rollback")
    for producer, consumer in handoffs(roles):
        p, c = roles[producer].total, roles[consumer].total
        if p >= 1 and c >= 1 and p % c:  # totals < 1 are reported by the core's validation
            raise SpecError(
                f"roles.{producer}.total", p, f"a multiple of roles.{consumer}.total={c}",
                f"the {p} results of {producer!r} are split in order over the {c} "
                f"{consumer!r} ranks")
    gen = generator_role(roles)
    if rl.prompts_per_iter and 1 <= rl.prompts_per_iter < roles[gen].total:
        raise SpecError("config.rl.prompts_per_iter", rl.prompts_per_iter,
                        f"0 or at least roles.{gen}.total={roles[gen].total}",
                        "every generating rank needs at least one prompt")


def apply_ppo(spec: Any) -> None:
    """Template defaults and checks for ``ppo``: fills ``config.rl`` with the PPO
    defaults (see :class:`~dlrover_plugin_ppo.config.RLConfig`), and checks that every
    result hand-off splits evenly (a producer's ``total`` is a multiple of its
    consumer's). Raises ``SpecError``."""
    _apply("ppo", spec)


def apply_grpo(spec: Any) -> None:
    """Template defaults and checks for ``grpo`` (as :func:`apply_ppo`, GRPO defaults;
    ``samples_per_prompt`` >= 2)."""
    _apply("grpo", spec)


@hookimpl
def dlrover_graph_templates() -> list[GraphTemplate]:
    ppo_roles = (
        RoleTemplate("actor", True, _ROLES["actor"]),
        RoleTemplate("critic", True, _ROLES["critic"]),
        RoleTemplate("rollout", False, _ROLES["rollout"]),
        RoleTemplate("reference", False, _ROLES["reference"]),
        RoleTemplate("reward", False, _ROLES["reward"]),
    )
    grpo_roles = tuple(r for r in ppo_roles if r.name != "critic")
    fwd = (("rollout", "reward"), ("rollout", "reference"), ("rollout", "actor"),
           ("reward", "actor"), ("reference", "actor"))
    return [
        GraphTemplate(
            name="ppo",
            description="PPO with GAE: rollout -> reward/reference/critic -> actor; "
                        "actor weights synced back to rollout",
            roles=ppo_roles,
            edges=fwd + (("rollout", "critic"), ("critic", "actor")),
            driver=DRIVER,
            apply=apply_ppo,
        ),
        GraphTemplate(
            name="grpo",
            description="GRPO: group-relative advantages over samples of each prompt, "
                        "no critic",
            roles=grpo_roles,
            edges=fwd,
            driver=DRIVER,
            apply=apply_grpo,
        ),
    ]
