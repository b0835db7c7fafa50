"""The base class of the five RL roles (:class:`RLWorkload`): the job's RL settings,
torch set-up, and the state a role checkpoints at the driver's iteration boundary and
restores to the driver's last commit after a failure (:meth:`RLWorkload.save_state`,
:meth:`RLWorkload.restore_state`; docs/ppo.md, "Failover"). The roles themselves are in
:mod:`dlrover_plugin_ppo.workloads`."""

from __future__ import annotations

from typing import Any

import torch

from dlrover_core import BaseWorkload, trainer_invocation
from dlrover_core.checkpoint.checkpointer import Checkpointer
from dlrover_plugin_ppo.config import RLConfig
from dlrover_plugin_ppo.shared_weights import SharedWeights


#: Seed offsets per role, so that ranks of different roles never share a stream.
_ROLE_SEED = {"actor": 0, "rollout": 1000, "reference": 2000, "reward": 3000, "critic": 4000}


class RLWorkload(BaseWorkload):
    """Common helpers of the RL roles: :attr:`rl` settings and :meth:`init_torch`."""

    _rl: RLConfig | None = None

    @property
    def rl(self) -> RLConfig:
        """The job's ``config.rl`` (validated, with the template's defaults)."""
        if self._rl is None:
            algorithm = str(self.config.get("rl_algorithm", "ppo"))
            self._rl = RLConfig.from_config(self.config, algorithm)
        return self._rl

    #: how the last weights arrived: ``"cuda_ipc"`` (:meth:`set_weights_shared`),
    #: ``"host"`` (``set_weights`` called with a state dict) or ``None`` (none yet)
    weights_transport: str | None = None

    def set_weights_shared(self, shared: SharedWeights | list | None) -> Any:
        """Load weights shared over CUDA IPC: map the actor's tensors
        (:meth:`SharedWeights.open`), hand them to ``set_weights`` (which copies them
        into this rank's policy, device to device), wait for the copies, drop the
        mappings. Returns what ``set_weights`` returned, or ``None`` when ``shared`` is
        ``None`` or cannot be opened here (another node or GPU): the driver then sends
        the host copy to ``set_weights``."""
        if isinstance(shared, list):  # a DRef consumed whole: one result per actor rank
            shared = shared[0]
        if shared is None or not shared.openable():
            return None
        views = shared.open()
        try:
            out = self.set_weights(views)  # type: ignore[attr-defined]
            torch.cuda.synchronize(shared.device_index)
        finally:
            del views
        self.weights_transport = "cuda_ipc"
        return out

    def init_torch(self, seed: int | None = None, threads: int | None = None) -> int:
        """Set torch's intra-op threads (``config.torch_threads``, default 1: roles
        share few cores) and seed torch with ``seed`` (default ``config.seed``, 0)
        plus a per-role, per-rank offset. Returns the seed used."""
        torch.set_num_threads(int(threads or self.config.get("torch_threads", 1)))
        base = int(self.config.get("seed", 0) if seed is None else seed)
        s = base + _ROLE_SEED.get(self.role, 5000) + 17 * self.rank
        torch.manual_seed(s)
        return s

    # ------------------------------------------------------------------ state
    def state_objects(self) -> dict[str, Any] | None:
        """What this role checkpoints at the driver's iteration boundary, as
        ``Checkpointer.save`` objects (``{"policy": module, "optimizer":
        OptimizerState(...), "rng": TorchRNG()}``), or ``None``: the role is stateless
        (its replacement needs only the actor's weights). Default ``None``; the actor and
        the critic return their model, optimizer and RNG. ``roles.<role>.config.stateful:
        false`` in the job spec turns a role's checkpoint off. Saved and restored by the
        core's :class:`~dlrover_core.runtime.role_state.RoleState` (``save_state``,
        ``restore_state``, ``has_state`` of ``BaseWorkload``)."""
        return None

    @trainer_invocation(target="RANK0")
    def failover_policy(self) -> str:
        """``roles.<role>.config.failover``: ``replace`` (stateless: the driver retries
        its call on a replacement) or ``rollback`` (the default; the ``ppo``/``grpo``
        templates set ``replace`` for rollout, reward and reference)."""
        from dlrover_core.graph.graph import check_failover_policy

        return check_failover_policy(self.role, self.config.get("failover"))

    @trainer_invocation(target="RANK0")
    def has_state(self) -> bool:
        """Whether :meth:`state_objects` names anything (asked by the driver once)."""
        return super().has_state()

    @property
    def state_checkpointer(self) -> Checkpointer:
        """The checkpointer of ``save_state`` (:attr:`RoleState.checkpointer`)."""
        return self.role_state.checkpointer

    def restore_state(self, step: int) -> int | None:
        """``BaseWorkload.restore_state``, after dropping the batch kept for a retried
        call (:meth:`generate_iteration`)."""
        self._iteration_cache = None
        return super().restore_state(step)

    # ------------------------------------------------------------------ generation
    _iteration_cache: tuple[int, Any] | None = None
    _iteration_stats: dict[int, dict[str, Any]] | None = None

    def generate_iteration(self, iteration: int, prompt_ids: list[int] | None = None) -> Any:
        """What the driver calls: ``generate(iteration, prompt_ids)`` then ``stats()``
        once, kept as this iteration's stats (:meth:`iteration_stats`; a redone iteration
        replaces them). Idempotent by iteration: a second call for the iteration just
        generated (a retried call) returns the same batch without stepping again."""
        cached = self._iteration_cache
        if cached is not None and cached[0] == int(iteration):
            return cached[1]
        batch = self.generate(int(iteration), prompt_ids)  # type: ignore[attr-defined]
        stats = getattr(self, "stats", None)
        if self._iteration_stats is None:
            self._iteration_stats = {}
        self._iteration_stats[int(iteration)] = dict(stats() if stats is not None else {})
        for old in sorted(self._iteration_stats)[:-4]:
            del self._iteration_stats[old]
        self._iteration_cache = (int(iteration), batch)
        return batch

    def iteration_stats(self, iteration: int) -> dict[str, Any]:
        """The stats of ``iteration``'s :meth:`generate_iteration` (``{}`` when this rank
        did not generate it)."""
        return dict((self._iteration_stats or {}).get(int(iteration), {}))


def _mean_stats(acc: dict[str, list[float]]) -> dict[str, float]:
    return {k: float(sum(v) / len(v)) for k, v in acc.items() if v}
