"""The JobMaster: one named, detached Ray actor per job, a thin facade over the
controller (:mod:`dlrover_core.master.controller`).

The client calls ``start``, ``status``, ``stop``, ``wait`` and ``shutdown``; workers
call ``report`` (or their node's agent ``report_batch``), ``checkpoint_loaded`` and ``checkpoint_saved`` (concurrency group
``report``: one at a time, in each sender's order), which go to the progress recorder.
A new master begins a new run in the job directory (:mod:`dlrover_core.runs`); a
restarted one goes on with the same run. When Ray restarts
the actor after it died, the new one re-attaches to the job from its JobContext.

Where things are: the state loop and its transitions in ``controller``, the state
table in ``states``, the instance model in ``instances``, placement and actor start-up
in ``launcher``, spares in ``standby``, failure detection in ``monitor``, the recovery
policy in ``failover`` and its execution in ``recovery``, master restarts in
``reattach``, step reports in ``progress``.
"""

from __future__ import annotations

import threading

import ray
from omegaconf import OmegaConf

from dlrover_core.master.controller import JobController
from dlrover_core.master.instances import DRIVER, Instance, InstanceFailure
from dlrover_core.master.monitor import failure_from_exception
from dlrover_core.master.states import JobState
from dlrover_core.plugins.manager import get_plugin_manager
from dlrover_core.runs import begin_run, latest_run
from dlrover_core.tuning.controller import TuningController

__all__ = ["DRIVER", "Instance", "InstanceFailure", "JobMaster", "failure_from_exception"]


class JobMaster:
    """Runs one job. Create with :func:`dlrover_core.master.client.create_master`.

    Args:
        spec: the validated job spec as plain containers.
        job_dir: the job directory (created if missing).
        fresh: start over: the previous run's checkpoints are moved aside to
            ``<job_dir>/run-<N>/ckpt`` instead of being resumed from
            (see :func:`dlrover_core.runs.begin_run`).
    """

    def __init__(self, spec: dict, job_dir: str, fresh: bool = False) -> None:
        try:
            run_id = ray.get_runtime_context().get_actor_id() or ""
        except Exception:  # noqa: BLE001 - not in an actor (unit use)
            run_id = ""
        if _was_reconstructed():  # the same run goes on (or has ended)
            run = latest_run(job_dir) or 1
        else:  # a new submit: a new run; the previous run's files move to run-<N>/
            ckpt = (spec.get("checkpoint") or {}).get("dir")
            run = begin_run(job_dir, run_id, fresh, checkpoint_dir=ckpt,
                            name=str(spec.get("name", ""))).run
        self.controller = JobController(OmegaConf.create(spec), job_dir, get_plugin_manager(),
                                        run_id, run=run)
        self.name = self.controller.scope.name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        context = self.controller.scope.context
        reattaching = _was_reconstructed() and context.get("state") not in (
            None, *(s.value for s in JobState if s.terminal))
        if not reattaching:
            context.clear()
            context.set("started_at", self.controller.scope.started_at)
        # after the clear: a restarted master's tuner continues from the persisted version
        scope = self.controller.scope
        self.tuning = TuningController.from_spec(scope.spec, scope.pm, store=context,
                                                 emit=scope.emit)
        self.controller.progress.tuning = self.tuning
        if reattaching:
            self._start_thread(reattaching=True)

    def _start_thread(self, reattaching: bool = False) -> None:
        self._thread = threading.Thread(target=self.controller.run, args=(reattaching,),
                                        name="job-master", daemon=True)
        self._thread.start()

    # ================================================================== client API
    def start(self) -> str:
        """Start the job in a background thread; returns the job name."""
        with self._lock:
            if self._thread is None:
                self._start_thread()
        return self.name

    def status(self) -> dict:
        """``name``, ``run``, ``job_dir``, ``state``, ``step``, ``started_at`` (unix s),
        ``resumed_from``, ``total_steps``, ``metrics``, ``restarts``,
        ``elapsed_s`` (s), ``error``, ``instances`` (label -> state, attempt, pid,
        node_id, step), ``standby`` (role -> warm), ``health`` (the plugins' failing checks,
        ``{check: details}``, :mod:`dlrover_core.master.health`) and, when finished,
        ``summary``."""
        return self.controller.status()

    def role_instance(self, role: str, rank: int) -> dict | None:
        """The instance now in ``role``'s slot ``rank``: ``{"attempt", "state",
        "handle"}`` (``None``: no such slot). A driver that keeps running while a
        stateless role is replaced rebinds to the new handle with it
        (:meth:`dlrover_core.master.recovery.RecoveryExecutor.current_instance`)."""
        return self.controller.recovery.current_instance(role, rank)

    def stop(self) -> None:
        """Ask the job to stop; it ends in state ``stopped``."""
        self.controller.stop()

    def wait(self, timeout: float | None = None) -> dict | None:
        """Block until the job ends (or ``timeout`` s); returns the summary or ``None``."""
        self.controller.done.wait(timeout)
        return self.controller.summary

    def shutdown(self) -> None:
        """Exit the master actor (after the job ended)."""
        self.controller.stop()
        self.controller.done.wait(30)
        ray.actor.exit_actor()

    # ================================================================== worker API
    @ray.method(concurrency_group="report")
    def report(self, role: str, rank: int, step: int, metrics: dict, ts: float) -> None:
        """A step report: ``metrics`` name -> float, ``ts`` the worker's unix time (s)."""
        progress = self.controller.progress
        progress.calls["report" if rank == 0 else "report_rank_n"] += 1
        progress.on_report(role, rank, step, metrics, ts)

    @ray.method(concurrency_group="report")
    def report_batch(self, entries: list, agent: str | None = None,
                     node_id: str | None = None) -> None:
        """Step reports of several ranks in one call (a node's agent,
        :mod:`dlrover_core.runtime.node_reporter`): ``entries`` of ``(role, rank, step,
        metrics, ts)``, each applied as :meth:`report` applies one. ``agent``: the
        sender's Ray actor name, ``node_id`` its node (hex): a restarted master asks
        that agent for the node's ranks."""
        self.controller.progress.on_batch(entries, agent, node_id)

    def tuning_sync(self, role: str, rank: int, initial: dict) -> dict | None:
        """A rank of ``role`` starts: the current tuning config as a dict (the first
        rank's ``initial`` settings become version 0), or ``None`` when the job does not
        tune ``role``. See :class:`dlrover_core.tuning.controller.TuningController`."""
        return self.tuning.sync(role, rank, initial) if self.tuning is not None else None

    def tuning_config(self, role: str) -> dict | None:
        """The current tuning config of ``role`` (polled by its rank 0), or ``None``."""
        if self.tuning is None or role != self.tuning.role:
            return None
        return self.tuning.current()

    def tuning_out_of_memory(self, role: str, rank: int, version: int,
                             error: str) -> dict | None:
        """Rank ``rank`` of ``role`` ran out of memory under tuning ``version``: the
        config its ranks roll back to (``None``: nothing to roll back to). See
        :meth:`dlrover_core.tuning.controller.TuningController.on_out_of_memory`."""
        if self.tuning is None:
            return None
        return self.tuning.on_out_of_memory(role, rank, version, error)

    @ray.method(concurrency_group="report")
    def checkpoint_loaded(self, role: str, rank: int, step: int, source: str | None,
                          path: str, attempt: int = 0) -> None:
        """Rank ``rank`` of ``role`` (its ``attempt``-th start) loaded checkpoint
        ``step`` (``source``: ``memory``, ``disk``, ... as the saver says; ``path``: the
        step's directory)."""
        self.controller.progress.on_checkpoint_loaded(role, rank, step, source, path, attempt)

    @ray.method(concurrency_group="report")
    def checkpoint_saved(self, role: str, rank: int, step: int, seconds: float) -> None:
        """Rank ``rank`` of ``role`` saved ``step``; its loop was blocked ``seconds`` s."""
        self.controller.progress.on_checkpoint_saved(role, rank, step, seconds)


    # ================================================================== shard service
    def shards_open(self, role: str, config: dict) -> int:
        """Open (or join) the shard service of ``role``; returns the data set size. See
        :class:`dlrover_core.master.shards.ShardRegistry`."""
        return self.controller.shards.open(role, config)

    def shards_lease(self, role: str, rank: int, generation: int) -> dict | None:
        """The next shard for ``rank`` of ``role`` (see ``ShardService.lease``)."""
        return self.controller.shards.get(role).lease(rank, generation)

    @ray.method(concurrency_group="report")
    def shards_report(self, role: str, generation: int, rank: int, step: int,
                      spans: list) -> None:
        """``rank`` of ``role`` trained ``spans`` in ``step`` (see ``ShardService.report``)."""
        self.controller.shards.get(role).report(generation, rank, step, spans)

    def shards_restore(self, role: str, step: int) -> dict:
        """Roll the shard service of ``role`` back to the reports of steps <= ``step``;
        ``{"generation", "read"}`` (see ``ShardService.restore``)."""
        return self.controller.shards.get(role).restore(step)

    def shards_restore_state(self, role: str, step: int, state: dict) -> dict:
        """Roll the shard service of ``role`` back to the checkpoint's shard ``state`` of
        ``step``; ``{"generation", "read"}`` (see ``ShardService.restore``)."""
        return self.controller.shards.get(role).restore(step, state)

    def shards_ledger(self) -> dict:
        """``samples_lost``, ``samples_duplicated`` and per role the ledger."""
        return self.controller.shards.ledger()


def _was_reconstructed() -> bool:
    """True when Ray restarted this (master) actor after it died."""
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - outside an actor
        return False
