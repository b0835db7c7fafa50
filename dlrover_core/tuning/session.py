"""The worker side of online tuning: one :class:`TuningSession` per rank.

It holds the rank's current :class:`~dlrover_core.tuning.config.TuningConfig`, the
step timer, and the things a config change acts on (the
:class:`~dlrover_core.tuning.dataloader.ElasticDataLoader`, the FSDP2 model, the
activation-checkpointing switch). At every step boundary (:meth:`TuningSession.boundary`)
the ranks agree on the config of the next step: rank 0 offers the newest version it
has from the master, and one ``torch.distributed`` broadcast of its version number
(plus the config itself when that differs from the ranks' own) gives every rank the
same answer at the same step, so no rank trains a step with another micro-batch than
its peers. Without a process group (one rank), rank 0's answer is taken directly.

Typical loop (see ``examples/nanogpt/tuned_workload.py``)::

    self.tuning = TuningSession.for_workload(self, {"dataloader": {"batch_size": 16}, ...})
    self.tuning.attach(loader=self.loader, model=self.model)
    for step in range(start, max_steps):
        self.tuning.boundary(step)
        timer = self.tuning.timer
        self.tuning.start_step()
        for i in range(self.tuning.grad_accum_steps):
            x, y = self.loader.next_batch(timer)
            with timer.phase("compute"), gradient_sync(model, i == self.tuning.grad_accum_steps - 1):
                (model(x, y) / self.tuning.grad_accum_steps).backward()
        with timer.phase("optimizer"):
            opt.step(); opt.zero_grad()
        self.report(step, loss=..., **self.tuning.end_step())
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.metrics import StepTimer
from dlrover_core.tuning.parallelism import ActivationCheckpointing, apply_parallelism

log = logging.getLogger(__name__)

SYNC_TIMEOUT_S = 60.0


class ConfigSource:
    """Where rank 0 learns about new versions. :meth:`sync` is the blocking first call
    (it may make ``initial`` version 0); :meth:`poll` never blocks and returns the
    newest config dict it has, or ``None``."""

    def sync(self, initial: dict) -> dict | None:
        raise NotImplementedError

    def poll(self) -> dict | None:
        raise NotImplementedError

    def out_of_memory(self, version: int, error: str) -> dict | None:
        """Rank 0 ran out of memory under ``version``: the config to continue with
        (blocking), or ``None`` when there is nothing to roll back to."""
        return None


class ControllerSource(ConfigSource):
    """A :class:`~dlrover_core.tuning.controller.TuningController` in this process
    (single-process training, the benchmark)."""

    def __init__(self, controller: Any, role: str, rank: int = 0) -> None:
        self.controller, self.role, self.rank = controller, role, rank

    def sync(self, initial: dict) -> dict | None:
        return self.controller.sync(self.role, self.rank, initial)

    def poll(self) -> dict | None:
        return self.controller.current()

    def out_of_memory(self, version: int, error: str) -> dict | None:
        return self.controller.on_out_of_memory(self.role, self.rank, version, error)


class MasterSource(ConfigSource):
    """The JobMaster (methods ``tuning_sync`` and ``tuning_config``), asked without
    blocking the training loop: one call in flight at a time; a master that is
    restarting is simply asked again later."""

    def __init__(self, workload: Any) -> None:
        self.workload = workload
        self._ref: Any = None

    def _master(self) -> Any:
        return self.workload._master_or_none()

    def sync(self, initial: dict) -> dict | None:
        import ray

        master = self._master()
        if master is None:
            return None
        w = self.workload
        return ray.get(master.tuning_sync.remote(w.role, w.rank, initial), timeout=SYNC_TIMEOUT_S)

    def poll(self) -> dict | None:
        import ray

        out = None
        if self._ref is not None:
            ready, _ = ray.wait([self._ref], timeout=0)
            if not ready:
                return None
            try:
                out = ray.get(self._ref)
            except Exception:  # noqa: BLE001 - master restarting: ask again next step
                self.workload._master = None
                out = None
            self._ref = None
        master = self._master()
        if master is not None:
            self._ref = master.tuning_config.remote(self.workload.role)
        return out

    def out_of_memory(self, version: int, error: str) -> dict | None:
        import ray

        master = self._master()
        if master is None:
            return None
        w = self.workload
        return ray.get(master.tuning_out_of_memory.remote(w.role, w.rank, version, error),
                       timeout=SYNC_TIMEOUT_S)


class TuningSession:
    """A rank's view of the tuned config.

    Args:
        initial: the settings the workload starts with (version 0 unless the master
            already has a newer version).
        rank, world_size: this rank of the tuned role.
        local_world_size: ranks on this node (for the memory capacity).
        source: where rank 0 gets new versions (``None``: the config never changes).
        sync_every_steps: agree on the config every this many steps (1: every step;
            0: never, the config stays as it is; must be the same on every rank).
    Raises:
        TuningConfigError: ``initial`` is invalid.
    """

    def __init__(self, initial: TuningConfig | dict, rank: int = 0, world_size: int = 1,
                 local_world_size: int = 1, source: ConfigSource | None = None,
                 sync_every_steps: int = 1) -> None:
        self.config = initial if isinstance(initial, TuningConfig) else \
            TuningConfig.from_dict(initial)
        self.rank, self.world_size = rank, world_size
        self.source = source
        self.sync_every_steps = max(0, int(sync_every_steps))
        self.timer = StepTimer(local_world_size=local_world_size)
        self.loader: Any = None
        self.model: Any = None
        self.checkpointing: ActivationCheckpointing | None = None
        self.switches: list[tuple[int, int]] = []  # (step, version) of every switch
        # (step, version that ran out of memory, version rolled back to)
        self.rollbacks: list[tuple[int, int, int]] = []
        self._offer: dict | None = None
        self._step_start: Any = None  # the loader's position when the step started
        if source is not None:
            current = source.sync(self.config.to_dict())
            if current is not None:
                self.config = TuningConfig.from_dict(current)

    @classmethod
    def for_workload(cls, workload: Any, initial: TuningConfig | dict) -> TuningSession:
        """The session of a ``BaseWorkload``: its rank and world size; the JobMaster as
        the source when the job has ``tuning.enabled`` (and a master), else static.
        A restarted rank starts from the master's current version. Without tuning the
        ranks never synchronise (no collective per step)."""
        ctx = workload.context
        enabled = bool((ctx.tuning or {}).get("enabled"))
        source = MasterSource(workload) if enabled and workload._master_or_none() is not None \
            else None
        return cls(initial, rank=ctx.rank, world_size=ctx.world_size,
                   local_world_size=ctx.local_world_size, source=source,
                   sync_every_steps=1 if enabled else 0)

    # ------------------------------------------------------------------ attaching
    def attach(self, loader: Any = None, model: Any = None, blocks: Any = None) -> None:
        """Register what a config change acts on and apply the current config to it:
        ``loader`` (an ``ElasticDataLoader``), ``model`` (for FSDP2 resharding),
        ``blocks`` (modules for activation checkpointing)."""
        if loader is not None:
            self.loader = loader
        if model is not None:
            self.model = model
        if blocks is not None:
            self.checkpointing = ActivationCheckpointing(blocks)
        self._apply(self.config)

    # ------------------------------------------------------------------ views
    @property
    def version(self) -> int:
        return self.config.version

    @property
    def micro_batch(self) -> int:
        return self.config.dataloader.batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.config.optimizer.grad_accum_steps

    @property
    def learning_rate(self) -> float:
        """The peak learning rate of the current config (a schedule scales it)."""
        return self.config.optimizer.learning_rate

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.config.global_batch(self.world_size)

    # ------------------------------------------------------------------ the boundary
    def boundary(self, step: int) -> bool:
        """Call on every rank before ``step`` starts. All ranks switch to the same
        config here or none does; returns whether this rank switched. A collective when
        the role has a process group: every rank must call it at every step."""
        if not self.sync_every_steps or step % self.sync_every_steps:
            return False
        offer = None
        if self.rank == 0 and self.source is not None:
            polled = self.source.poll()
            if polled is not None and int(polled["version"]) > self.config.version:
                self._offer = polled  # versions only grow: an older answer is stale
            offer = self._offer
        agreed = self._agree(offer)
        if agreed is None or agreed == self.config.to_dict():
            return False
        new = TuningConfig.from_dict(agreed)
        self._apply(new)
        self.switches.append((step, new.version))
        log.info("rank %d switched to tuning version %d at step %d", self.rank, new.version,
                 step)
        return True

    def _agree(self, offer: dict | None) -> dict | None:
        dist = _dist()
        if dist is None or self.world_size == 1:
            return offer
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        v = torch.tensor([-1 if offer is None else int(offer["version"])], dtype=torch.int64,
                         device=device)
        dist.broadcast(v, src=0)
        version = int(v.item())
        if version < 0 or version <= self.config.version:
            return None
        box = [offer if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=device)
        return box[0]

    def _apply(self, new: TuningConfig) -> None:
        d = new.dataloader
        if self.loader is not None:
            self.loader.reconfigure(d.batch_size, d.num_workers, d.pin_memory)
        apply_parallelism(new.parallelism, self.model, self.checkpointing)
        self.config = new

    # ------------------------------------------------------------------ out of memory
    def start_step(self) -> None:
        """Start the step's timer and remember the loader's position (where a step that
        runs out of memory rewinds to). Call after :meth:`boundary`."""
        self.timer.start_step()
        self._step_start = self.loader.position_marker() if self.loader is not None else None

    def out_of_memory(self, exc: BaseException, step: int) -> bool:
        """Roll back a step that ran out of memory under a tuned version, without a
        restart. Call it from the ``except`` around the step, on every rank (a
        collective: every rank must have run out of memory in the same step, which holds
        when the memory need follows the micro-batch that all ranks share; a rank that
        runs out alone leaves its peers in a collective until the process group's
        timeout, and the failover then restarts the group).

        Rank 0 tells the master (:meth:`TuningController.on_out_of_memory
        <dlrover_core.tuning.controller.TuningController.on_out_of_memory>`), which
        records the micro-batch as the ceiling and answers with the settings before the
        trial as a new version; every rank switches to it, the loader rewinds to the
        step's start (no sample is skipped) and the timer's step is dropped. The caller
        then clears the gradients and runs ``step`` again.

        Returns:
            ``True`` when rolled back; ``False`` when ``exc`` is not out of memory or
            there is nothing to roll back to (version 0, the job's own settings, or no
            master): re-raise it then.
        """
        failed = self.config.version
        if not is_out_of_memory(exc) or not self.sync_every_steps or failed == 0:
            return False  # (the same answer on every rank: they share the version)
        new = None
        if self.rank == 0 and self.source is not None:
            try:
                new = self.source.out_of_memory(failed, f"{type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - no answer: the peers still wait for one
                log.exception("asking the master about the out-of-memory step failed")
        new = self._share(new)
        if new is None or int(new["version"]) <= failed:
            return False
        _free_memory()
        self._offer = None
        self._apply(TuningConfig.from_dict(new))
        if self.loader is not None and self._step_start is not None:
            self.loader.rewind(self._step_start)
        self.timer.drop_step()
        self.rollbacks.append((step, failed, self.config.version))
        log.warning("rank %d ran out of memory at step %d under tuning version %d; rolled "
                    "back to version %d", self.rank, step, failed, self.config.version)
        return True

    def _share(self, obj: dict | None) -> dict | None:
        dist = _dist()
        if dist is None or self.world_size == 1:
            return obj
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend() == "nccl" else torch.device("cpu")
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=device)
        return box[0]

    # ------------------------------------------------------------------ metrics
    def end_step(self) -> dict[str, float]:
        """Close the timer's step; returns its metrics plus ``tuning_version``,
        ``micro_batch``, ``grad_accum_steps`` and ``num_workers`` (for ``report()``)."""
        m = self.timer.end_step(samples=self.global_batch)
        m.update(tuning_version=float(self.version), micro_batch=float(self.micro_batch),
                 grad_accum_steps=float(self.grad_accum_steps),
                 num_workers=float(self.config.dataloader.num_workers))
        return m


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error: ``MemoryError``,
    ``torch.cuda.OutOfMemoryError`` (``torch.OutOfMemoryError``), or a ``RuntimeError``
    whose message says ``out of memory`` or ``can't allocate memory`` (torch's CPU
    allocator)."""
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(exc, oom):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text
                                              or "can't allocate memory" in text)


def _free_memory() -> None:
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return None
    if dist.is_available() and dist.is_initialized():
        return dist
    return None
