"""The state of a driven role, checkpointed at its driver's commit (issue 57).

In a job with a driver (PPO, multimodal, a user's own graph), a role that holds
state (a model it trains, an optimizer, a random generator) must come back after a
failure at the driver's last commit, not at its initial weights. Two parts:

- worker side, :class:`RoleState` (one per workload, ``BaseWorkload.role_state``):
  what the role declares, and its save / restore with the job's saver. The driver
  reaches it through the workload's ``has_state``, ``save_state(step)`` and
  ``restore_state(step)`` (methods of every ``BaseWorkload``).
- driver side, :class:`RoleCommits` (``BaseTrainer.role_commits``): at an iteration
  boundary :meth:`RoleCommits.commit` has every stateful role save ``step`` (all
  ranks in parallel, each waits for its saver's commit), then writes the driver's own
  state: that write is the commit. After a restart :meth:`RoleCommits.rollback` puts
  every stateful role back to the committed step, asked for by number.

A role declares state in one of three ways (:func:`declared_objects`):

1. ``state_objects()`` returns ``Checkpointer.save`` objects (``{"model": module,
   "optimizer": opt, "rng": TorchRNG()}``); ``None`` means stateless;
2. the workload itself has ``state_dict()`` and ``load_state_dict(state)`` (a user's
   role outside the templates' base classes): its state dict is saved whole
   (:class:`WholeState`);
3. neither: stateless. ``roles.<role>.config.stateful: false`` turns a declared state
   off; ``stateful: true`` on a role that declares none is an error naming the role.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from dlrover_core.spec.errors import SpecError

if TYPE_CHECKING:
    from dlrover_core.checkpoint.checkpointer import Checkpointer

# the workload (``BaseWorkload``) and the driver (``BaseTrainer``) are typed ``Any``
# here: their modules import this one
BaseWorkload = BaseTrainer = Any


class StateNotFound(RuntimeError):
    """A role was asked to restore a committed step that its saver does not have."""


class TorchRNG:
    """The process's torch CPU random generator as a checkpointable object (its
    ``state_dict`` is ``{"cpu": ByteTensor}``): a role restored to a commit draws
    what it would have drawn (sampling, shuffles, dropout)."""

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        torch.set_rng_state(state["cpu"])


class OptimizerState:
    """An optimizer as a checkpointable object keyed by parameter names
    (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``), so that a
    freshly made optimizer (no moments yet) loads the moments of a trained one: a plain
    ``optimizer`` object would give the saver an empty ``state`` as the template to
    load into, and the moments would stay empty."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer

    @classmethod
    def for_checkpointer(cls, checkpointer: Any, model: Any, optimizer: Any) -> Any:
        """What to give ``checkpointer.save/load`` as the optimizer: this wrapper under
        the plain engine (no backend, or one without a state-dict engine); the optimizer
        itself under a backend's engine (``dcp`` for ``ddp``/``fsdp``), which keys it by
        parameter names on its own and needs the optimizer."""
        from dlrover_core.checkpoint.engine import PlainEngine

        return cls(model, optimizer) if type(checkpointer.engine) is PlainEngine else optimizer

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state by parameter name. On a fresh optimizer (no moments
        yet: the template of a load) torch makes its state with a zero-lr step; that
        state is dropped again, so an optimizer for which no checkpoint exists trains
        as a fresh one (Adam's step count starts at 0)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fresh = not self.optimizer.state
        out = get_optimizer_state_dict(self.model, self.optimizer)
        if fresh:
            self.optimizer.state.clear()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


class WholeState:
    """A workload's own ``state_dict()`` / ``load_state_dict(state)`` pair as one
    checkpointable object: the state dict is written whole (``torch.save`` bytes), so
    that what the role loads is what it saved, whatever its structure (an optimizer's
    moments, counters, lists that grow): a saver that loads into a template of the
    current state (DCP) would otherwise skip the keys a fresh role does not have yet.
    For a large model return it from ``state_objects()`` instead: the saver then writes
    its tensors itself (sharded, without a copy into bytes)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def state_dict(self) -> dict[str, bytes]:
        import io

        import torch

        buf = io.BytesIO()
        torch.save(self.owner.state_dict(), buf)
        return {"torch_save": buf.getvalue()}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        import io

        import torch

        self.owner.load_state_dict(torch.load(io.BytesIO(state["torch_save"]),
                                              weights_only=False))


def _stateful_flag(workload: BaseWorkload) -> bool | None:
    """``roles.<role>.config.stateful`` (``None`` when not set).

    Raises:
        SpecError: a value other than true / false.
    """
    value = workload.config.get("stateful", None)
    if value is None or isinstance(value, bool):
        return value
    raise SpecError(f"roles.{workload.role}.config.stateful", value, "true or false",
                    "true: the role's state is checkpointed at the driver's commit; false: "
                    "it is not (the role starts from setup() after a restart)")


def declared_objects(workload: BaseWorkload) -> dict[str, Any] | None:
    """What ``workload`` checkpoints at its driver's commit, as ``Checkpointer.save``
    objects, or ``None`` (stateless). See the module docstring for the three ways.

    Raises:
        SpecError: ``roles.<role>.config.stateful`` is not a bool, or is true on a role
            that declares no state.
    """
    flag = _stateful_flag(workload)
    if flag is False:
        return None
    objs = workload.state_objects()
    if not objs and callable(getattr(workload, "state_dict", None)) \
            and callable(getattr(workload, "load_state_dict", None)):
        objs = {"state": WholeState(workload)}
    if not objs:
        if flag:
            raise SpecError(f"roles.{workload.role}.config.stateful", True,
                            "false, or a workload that declares its state",
                            f"{type(workload).__name__} has neither state_objects() nor a "
                            "state_dict()/load_state_dict() pair")
        return None
    return dict(objs)


class RoleState:
    """One rank's save and restore of its declared state (see the module docstring)."""

    def __init__(self, workload: BaseWorkload) -> None:
        self.workload = workload
        self._checkpointer: Checkpointer | None = None

    def objects(self) -> dict[str, Any] | None:
        return declared_objects(self.workload)

    @property
    def checkpointer(self) -> Checkpointer:
        """The job's saver (``checkpoint.saver``) under ``<checkpoint.dir>/<role>``;
        ranks of a role without a process group (each its own state, e.g. rollout
        workers) get one lineage each, under ``<checkpoint.dir>/by-rank/<rank>/<role>``."""
        if self._checkpointer is not None:
            return self._checkpointer
        from dlrover_core.checkpoint.checkpointer import Checkpointer

        w = self.workload
        ctx = w.context
        if ctx.backend or ctx.world_size == 1:
            ck = w.checkpointer
        else:
            base = ctx.checkpoint.get("dir") or os.path.join(ctx.job_dir, "ckpt")
            own = dataclasses.replace(
                ctx, rank=0, world_size=1,
                checkpoint={**dict(ctx.checkpoint),
                            "dir": os.path.join(str(base), "by-rank", str(w.rank))})
            ck = Checkpointer.for_worker(own, w)
        self._checkpointer = ck
        return ck

    def save(self, step: int) -> int | None:
        """Checkpoint the declared objects as ``step`` and wait until the saver committed
        it. Returns ``step``, or ``None`` for a stateless role."""
        objs = self.objects()
        if objs is None:
            return None
        ck = self.checkpointer
        ck.save(int(step), **objs)
        ck.wait()
        return int(step)

    def restore(self, step: int) -> int | None:
        """Put this rank back to committed ``step``: step 0 is the state ``setup()``
        makes, so ``teardown()`` and ``setup()`` run again; a later step is loaded from
        the saver. Returns ``step`` (``None`` for a stateless role).

        Raises:
            StateNotFound: the saver has no step ``step`` (never falls back to another).
            CheckpointLoadError: the step exists but does not load.
        """
        if self.objects() is None:
            return None
        w = self.workload
        if int(step) == 0:
            w.teardown()
            w.setup()
            return 0
        ck = self.checkpointer
        loaded = ck.load(int(step), **self.objects())
        if loaded != int(step):
            raise StateNotFound(
                f"{w.role}-{w.rank}: the driver committed step {step}, but the checkpoint "
                f"directory {ck.saver.config.dir} has "
                f"{ck.saver.committed_steps() or 'no committed steps'}")
        return loaded


class RoleCommits:
    """The driver's side: which roles are stateful, the commit, the rollback."""

    def __init__(self, trainer: BaseTrainer) -> None:
        self.trainer = trainer
        self._stateful: list[str] | None = None

    def _group(self, role: str) -> Any:
        return self.trainer._context.role_groups[role]

    @property
    def stateful(self) -> list[str]:
        """Roles whose rank 0 says ``has_state()`` (asked once, while every role is up)."""
        if self._stateful is None:
            self._stateful = [
                r for r in self.trainer.get_role_groups()
                if callable(getattr(self.trainer.actor_classes.get(r), "has_state", None))
                and self._group(r).has_state.options(target="RANK0", blocking=True)()]
        return list(self._stateful)

    def commit(self, step: int, state: dict) -> None:
        """Every rank of every stateful role saves ``step`` (in parallel; each waits for
        its saver's commit), then the driver's ``state`` is written atomically with
        ``committed_step: step`` (``BaseTrainer.save_state``): that write is the commit.
        A role's step above the committed one is never loaded."""
        calls = [self._group(r).save_state.options(blocking=False)(int(step))
                 for r in self.stateful]
        for c in calls:
            c.get()
        self.trainer.save_state({**state, "committed_step": int(step)})

    def rollback(self, step: int) -> None:
        """Every rank of every stateful role back to committed ``step`` (0: their
        ``setup()`` state). Raises what a rank's ``restore_state`` raised
        (:class:`StateNotFound`, ``CheckpointLoadError``)."""
        calls = [self._group(r).restore_state.options(blocking=False)(int(step))
                 for r in self.stateful]
        for c in calls:
            c.get()


__all__ = ["OptimizerState", "RoleCommits", "RoleState", "StateNotFound", "TorchRNG",
           "WholeState", "declared_objects"]
