"""``RLJobBuilder``: build ``ppo`` / ``grpo`` jobs in Python.

Example::

    from dlrover_plugin_ppo.builder import RLJobBuilder

    job = (RLJobBuilder("ppo")
           .name("cartpole")
           .rl(iterations=300, target_return=475, minibatch_unit="step")
           .actor("examples.ppo_cartpole.workload", "CartPoleActor").resource(cpu=0.25)
           .critic("examples.ppo_cartpole.workload", "CartPoleCritic").resource(cpu=0.25)
           .rollout("examples.ppo_cartpole.workload", "CartPoleRollout").total(2)
               .resource(cpu=0.5)
           .with_collocation("actor", "rollout")
           .build())
    summary = job.submit()

It is a :class:`dlrover_core.DLJobBuilder` (whose ``actor``/``rollout``/``reference``/
``reward``/``critic`` shortcuts name the roles) with ``dl_type("RL")``, the template
chosen up front and :meth:`rl` for ``config.rl``.
"""

from __future__ import annotations

import copy
from typing import Any

from dlrover_core import DLJobBuilder, SpecError
from dlrover_plugin_ppo.config import ALGORITHMS


class RLJobBuilder(DLJobBuilder):
    """A job builder for the ``ppo`` (default) or ``grpo`` template."""

    def __init__(self, algorithm: str = "ppo") -> None:
        super().__init__()
        if algorithm not in ALGORITHMS:
            raise SpecError("template", algorithm, ", ".join(ALGORITHMS))
        self.dl_type("RL")
        self.template(algorithm)
        self._rl: dict[str, Any] = {}

    def rl(self, **settings: Any) -> RLJobBuilder:
        """Set ``config.rl`` keys (see :class:`dlrover_plugin_ppo.config.RLConfig`);
        validated by :meth:`build`."""
        self._rl.update(settings)
        return self

    def to_dict(self) -> dict:
        spec = super().to_dict()
        if self._rl:
            config = copy.deepcopy(spec.get("config") or {})
            config["rl"] = {**(config.get("rl") or {}), **self._rl}
            spec["config"] = config
        return spec
