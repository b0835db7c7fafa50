"""The master side of online tuning: metric collector + strategy generator (seed 001).

:class:`TuningController` lives in the JobMaster. The master hands it every step
report (:meth:`~TuningController.on_report`) and the ranks' first call
(:meth:`~TuningController.sync`); the ranks poll :meth:`~TuningController.current`
and switch at a common step boundary (see :mod:`dlrover_core.tuning.session`).

The loop, per tuned role::

    baseline: guard.windows windows of interval_steps steps of version N (rank 0's
      reports; each window's throughput is its samples over its wall time)
      -> tuners propose (a tuner that raises is skipped): one change per round,
         the tuners taking turns (one_change_per_round), or every tuner's change
         merged (tuning.tuners order wins on a shared key)
      -> version N+1                                    event tuning_proposed
      -> ranks report steps under N+1                   event tuning_applied
      -> warmup_steps skipped, and after them the steps that report loader_refill
         (the change's transition in an ElasticDataLoader: metrics.py),
         guard.windows windows measured (whole loader waves)
      -> guard (Welch's t-test of the window rates, see guard.py): undecided with
                guard.max_windows set: measured on to it  event tuning_extended
                kept (its windows are the new baseline)  event tuning_accepted
                or reverted to N's settings as N+2      event tuning_reverted
                (and a fresh baseline is measured)
    a rank that runs out of memory under N+1            event tuning_out_of_memory
      -> N's settings as N+2 at once (the ranks roll back without a restart), and the
         micro-batch that failed is the ceiling: nothing at or above it is proposed again

A proposal whose settings were reverted is not proposed again unless the conditions
moved since (the baseline's samples/s by more than ``guard.retry_shift``, relative,
or its data-wait share by more than that, absolute; or, when no tuner has a proposal,
a setting the change does not touch is different now), and then at most
``guard.max_retries`` times (event ``tuning_retry``). The controller's state (current
and previous config, phase, measured windows, baseline, history, rejected settings,
memory ceiling, each tuner's state) is written to the job's store (``JobContext``,
key ``tuning``) at every change, so a restarted master continues from the current
version. It never raises into the master (a tuner's exception: ``tuning_tuner_failed``).
"""

from __future__ import annotations

import logging
import threading
import traceback
from typing import Any, Callable

from dlrover_core.tuning import waves
from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.controller_state import STORE_KEY, ControllerState
from dlrover_core.tuning.guard import Guard
from dlrover_core.tuning.lr_scaling import scaled_learning_rate
from dlrover_core.tuning.proposals import ask_tuners, pick_retry
from dlrover_core.tuning.tuner import TunerBase, WindowSummary

log = logging.getLogger(__name__)

__all__ = ["STORE_KEY", "TuningController"]


class TuningController(ControllerState):
    """Collects step metrics of one role and turns them into config versions.

    Args:
        tuners: ``(name, tuner)`` pairs in priority order (an earlier tuner's change to
            a key wins over a later one's).
        role: the tuned role (reports of other roles are ignored).
        world_size: ranks of that role.
        interval_steps: steps per measurement window (>= 1).
        warmup_steps: steps skipped after a switch before measuring (>= 0).
        guard: decides whether a tried change stays.
        lr_scaling: ``linear``/``sqrt``/``none`` (see :mod:`~dlrover_core.tuning.lr_scaling`).
        store: an object with ``get(key, default)`` and ``set(key, value)`` (the
            JobContext) or ``None``.
        emit: ``emit(event, **fields)`` for ``events.jsonl``.
        one_change_per_round: try one tuner's change at a time, the tuners taking
            turns (the guard's verdict then belongs to that change alone); ``False``:
            merge every tuner's change into one version.
    """

    def __init__(self, tuners: list[tuple[str, TunerBase]], role: str, world_size: int = 1,
                 interval_steps: int = 20, warmup_steps: int = 2, guard: Guard | None = None,
                 lr_scaling: str = "linear", store: Any = None,
                 emit: Callable[..., Any] | None = None,
                 one_change_per_round: bool = True) -> None:
        if interval_steps < 1:
            raise ValueError(f"interval_steps={interval_steps} is invalid; allowed: >= 1")
        self.tuners = tuners
        for name, t in tuners:
            t.name = name
        self.role, self.world_size = role, world_size
        self.interval_steps, self.warmup_steps = interval_steps, warmup_steps
        self.guard = guard or Guard()
        self.lr_scaling = lr_scaling
        self.one_change_per_round = one_change_per_round
        self._turn = 0  # with one_change_per_round: the tuner asked first next round
        self.store = store
        self.emit = emit or (lambda event, **fields: None)  # outside a JobMaster
        self.config: TuningConfig | None = None
        self.previous: TuningConfig | None = None
        self.phase = "baseline"          # baseline | trial
        self.baseline: WindowSummary | None = None
        self.trial_changes: dict[str, dict] = {}
        self.applied_step: int | None = None  # first step reported under the current version
        self.history: list[dict] = []
        # reverted changes: {"settings", "change", "tuners", "baseline", "retries"}
        self.rejected: list[dict] = []
        self.memory_ceiling: int | None = None  # smallest micro-batch that ran out of memory
        self.windows: list[WindowSummary] = []  # closed windows of the current version
        self._window: list[tuple[int, dict]] = []
        self._memory: dict[int, float] = {}
        self._capacity: dict[int, float] = {}
        #: rank -> the phase metrics of its reports in the open window (every rank)
        self._phases: dict[int, list[dict]] = {}
        self._last_step: int | None = None  # rank 0's last reported step (restart detection)
        self._lock = threading.RLock()  # reports and config polls come from other threads
        self._restore()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, spec: Any, plugin_manager: Any, store: Any = None,
                  emit: Callable[..., Any] | None = None) -> TuningController | None:
        """The controller of a validated job spec, or ``None`` when tuning is off.
        Tuner classes are resolved through the plugin manager's ``dlrover_tuners``.

        Raises:
            UnknownPluginError: a tuner name nobody provides (the spec loader checks
                this before anything starts).
        """
        from dlrover_core.tuning.spec import controller_arguments

        kwargs = controller_arguments(spec, plugin_manager)
        return None if kwargs is None else cls(**kwargs, store=store, emit=emit)

    # ------------------------------------------------------------------ worker API
    def sync(self, role: str, rank: int, initial: dict) -> dict | None:
        """A rank's first call: the current config as a dict. The first call of the
        tuned role makes ``initial`` (the workload's own settings) version 0; later
        calls (other ranks, restarted workers) get the current version.

        Raises:
            TuningConfigError: ``initial`` is not a valid config.
        """
        if role != self.role:
            return None
        with self._lock:
            return self._sync(role, initial)

    def _sync(self, role: str, initial: dict) -> dict:
        if self.config is None:
            self.config = TuningConfig.from_dict({**initial, "version": 0})
            self.history.append({"version": 0, "kind": "initial",
                                 "settings": self.config.settings()})
            self.emit("tuning_started", role=role, tuners=[n for n, _ in self.tuners],
                      interval_steps=self.interval_steps, config=self.config.to_dict())
            self._persist()
        return self.config.to_dict()

    def current(self) -> dict | None:
        """The current config as a dict (``None`` before the first :meth:`sync`)."""
        with self._lock:
            return None if self.config is None else self.config.to_dict()

    def on_report(self, role: str, rank: int, step: int, metrics: dict) -> None:
        """One step report. Uses ``tuning_version`` and the step metrics of
        :mod:`dlrover_core.tuning.metrics`; reports without ``tuning_version`` or of
        another version than the current one are ignored."""
        try:
            with self._lock:
                self._on_report(role, rank, step, metrics)
        except Exception:  # noqa: BLE001 - tuning must never stop the job
            log.exception("tuning controller failed on a report")
            self.emit("tuning_error", error=traceback.format_exc()[-2000:])

    def _on_report(self, role: str, rank: int, step: int, metrics: dict) -> None:
        if role != self.role or self.config is None:
            return
        v = metrics.get("tuning_version")
        if v is None or int(v) != self.config.version:
            return
        mem = metrics.get("cuda_max_allocated_bytes", metrics.get("peak_rss_bytes"))
        if rank != 0:
            if mem is not None:
                self._memory[rank] = max(self._memory.get(rank, 0.0), float(mem))
            if "memory_capacity_bytes" in metrics:
                self._capacity[rank] = float(metrics["memory_capacity_bytes"])
            if self.applied_step is not None and step >= self.applied_step + \
                    waves.warmup_steps(self.warmup_steps, self.config):
                self._phases.setdefault(rank, []).append(metrics)
            return
        restarted = self._last_step is not None and step <= self._last_step
        self._last_step = step
        if self.applied_step is None or step < self.applied_step or restarted:
            first = self.applied_step is None
            # first report under this version, or the ranks resumed from a checkpoint:
            # skip warmup_steps again and measure afresh
            self.applied_step = step
            self._reset_window()
            self.windows = []
            if first and self.config.version > 0:
                self.emit("tuning_applied", version=self.config.version, step=step,
                          config=self.config.to_dict())
            self._persist()
        if step < self.applied_step + waves.warmup_steps(self.warmup_steps, self.config):
            return
        if metrics.get("loader_refill") and not self._window and not self.windows:
            return  # still the transition: handed-over batches or the first wave
        if mem is not None:
            self._memory[0] = max(self._memory.get(0, 0.0), float(mem))
        if "memory_capacity_bytes" in metrics:
            self._capacity[0] = float(metrics["memory_capacity_bytes"])
        self._window.append((step, dict(metrics)))
        self._phases.setdefault(0, []).append(metrics)
        if len(self._window) >= waves.window_steps(self.interval_steps, self.config):
            self._close_window()

    # ------------------------------------------------------------------ the loop
    def _reset_window(self) -> None:
        self._window, self._memory, self._capacity, self._phases = [], {}, {}, {}

    def _close_window(self) -> None:
        assert self.config is not None
        self.windows.append(WindowSummary.from_reports(
            self.config.version, self._window, self._memory, self._capacity,
            self.world_size, phases_by_rank=self._phases))
        self._reset_window()
        if len(self.windows) < self.guard.windows_to_judge(self.phase == "trial",
                                                           len(self.windows)):
            self._persist()
            return
        window = WindowSummary.merge(self.windows)
        verdict = None
        if self.phase == "trial" and self.baseline is not None:
            verdict = self.guard.judge(self.baseline, window)
            if verdict.more:
                self.emit("tuning_extended", version=self.config.version,
                          reason=verdict.reason, windows=self.guard.max_windows)
                self._persist()
                return
        self.windows = []
        if verdict is not None:
            figures = {"before": self.baseline.as_dict(), "after": window.as_dict()}
            for name, t in self.tuners:
                if name in self.trial_changes:
                    self._feedback(name, t, self.trial_changes[name], verdict.keep, window)
            if verdict.keep:
                self._mark(self.config.version, "accepted", window)
                self.emit("tuning_accepted", version=self.config.version,
                          reason=verdict.reason, **figures)
                self.baseline, self.phase = window, "baseline"
            else:
                self._revert("tuning_reverted", verdict.reason, window, **figures)
                self._persist()
                return
        else:
            self.baseline, self.phase = window, "baseline"
        self.trial_changes = {}
        self._propose(window)
        self._persist()

    def _revert(self, event: str, reason: str, window: WindowSummary | None,
                 **fields: Any) -> None:
        """Publish the settings before the current trial as a new version."""
        assert self.config is not None and self.previous is not None
        reverted = self.config
        known = next((r for r in self.rejected if r["settings"] == reverted.settings()), None)
        if known is None:
            self.rejected.append({
                "settings": reverted.settings(), "change": self.previous.diff(reverted),
                "tuners": sorted(self.trial_changes), "retries": 0,
                "baseline": None if self.baseline is None else self.baseline.as_dict()})
        elif self.baseline is not None:  # a retry that failed again: its new conditions
            known["baseline"] = self.baseline.as_dict()
        self._mark(reverted.version, "reverted", window)
        self.config = self.previous.with_version(reverted.version + 1)
        self.previous = reverted
        self.history.append({"version": self.config.version, "kind": "revert",
                             "reverts": reverted.version, "settings": self.config.settings()})
        self.emit(event, version=self.config.version, reverted_version=reverted.version,
                  reason=reason, config=self.config.to_dict(), **fields)
        self.phase, self.baseline, self.applied_step = "baseline", None, None
        self.trial_changes, self.windows = {}, []
        self._reset_window()

    # ------------------------------------------------------------------ out of memory
    def on_out_of_memory(self, role: str, rank: int, version: int, error: str = "") -> dict | None:
        """Rank ``rank`` of ``role`` ran out of memory in a step under ``version``.
        Records that version's micro-batch as the memory ceiling (no proposal reaches
        it again) and, when ``version`` is the trial in progress, reverts it at once to
        the settings before (a new version). Returns the config the ranks continue with
        (a dict whose version is above ``version``), or ``None`` when there is nothing
        to roll back to (``version`` is the job's own version 0, or another role).
        """
        if role != self.role:
            return None
        with self._lock:
            if self.config is None:
                return None
            failed = next((h for h in self.history if h["version"] == version
                           and h["kind"] != "initial"), None)
            if failed is None:
                return None  # the job's own settings (or unknown): nothing to go back to
            mb = int(failed["settings"]["dataloader"]["batch_size"])
            self.memory_ceiling = mb if self.memory_ceiling is None else \
                min(self.memory_ceiling, mb)
            reason = (f"rank {rank} ran out of memory at micro-batch {mb}: "
                      f"{error[:300]}").rstrip(": ")
            if self.config.version == version and self.phase == "trial" and \
                    self.previous is not None:
                for name, t in self.tuners:
                    if name in self.trial_changes:
                        self._feedback(name, t, self.trial_changes[name], False, None)
                        self._tuner_oom(name, t, self.config)
                self._revert("tuning_out_of_memory", reason, None,
                             memory_ceiling=self.memory_ceiling)
            else:  # already reverted or moved on: the ceiling is all that is left to do
                for name, t in self.tuners:
                    self._tuner_oom(name, t, TuningConfig.from_dict(
                        {**failed["settings"], "version": version}))
                self.emit("tuning_out_of_memory", version=self.config.version,
                          reverted_version=version, reason=reason,
                          config=self.config.to_dict(), memory_ceiling=self.memory_ceiling)
            self._persist()
            return self.config.to_dict()

    def _tuner_oom(self, name: str, tuner: TunerBase, failed: TuningConfig) -> None:
        try:
            tuner.out_of_memory(failed)
        except Exception as exc:  # noqa: BLE001
            self._tuner_failed(name, "out_of_memory", exc)

    def _feedback(self, name: str, tuner: TunerBase, change: dict, keep: bool,
                  after: WindowSummary | None) -> None:
        try:
            tuner.feedback(change, keep, self.baseline, after)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            self._tuner_failed(name, "feedback", exc)

    def _tuner_failed(self, name: str, call: str, exc: BaseException) -> None:
        log.warning("tuner %s.%s raised %s: %s", name, call, type(exc).__name__, exc)
        self.emit("tuning_tuner_failed", tuner=name, call=call,
                  error=f"{type(exc).__name__}: {exc}",
                  traceback="".join(traceback.format_exception(exc))[-2000:])

    def _propose(self, window: WindowSummary) -> None:
        assert self.config is not None
        if self._retry(window):
            return
        merged, by_tuner, turn = ask_tuners(
            self.tuners, window, self.config,
            first=self._turn if self.one_change_per_round else None,
            refused=lambda cfg: self._is_rejected(cfg.settings()) or self._over_ceiling(cfg),
            failed=self._tuner_failed)
        if turn is not None:
            self._turn = turn
        if not merged:
            self._retry(window, settings_moved=True)
            return
        new = self.config.updated(merged, version=self.config.version + 1)
        old_gb, new_gb = (self.config.global_batch(self.world_size),
                          new.global_batch(self.world_size))
        if old_gb != new_gb and "learning_rate" not in merged.get("optimizer", {}):
            new = new.updated({"optimizer": {"learning_rate": scaled_learning_rate(
                self.config.optimizer.learning_rate, old_gb, new_gb, self.lr_scaling)}})
        refused = self._is_rejected(new.settings()) or self._over_ceiling(new)
        if new.same_settings(self.config) or refused:
            for name, t in self.tuners:  # tell them it will not be tried
                if name in by_tuner and refused:
                    self._feedback(name, t, by_tuner[name], False, None)
            return
        self._publish(new, by_tuner, window, "proposal")

    def _publish(self, new: TuningConfig, by_tuner: dict, window: WindowSummary,
                 kind: str) -> None:
        assert self.config is not None
        self.previous, self.config = self.config, new
        self.phase, self.trial_changes, self.applied_step = "trial", by_tuner, None
        self.history.append({"version": new.version, "kind": kind,
                             "tuners": sorted(by_tuner), "settings": new.settings()})
        self.emit("tuning_proposed" if kind == "proposal" else "tuning_retry",
                  version=new.version, from_version=self.previous.version,
                  tuners=sorted(by_tuner), changes=self.previous.diff(new),
                  config=new.to_dict(), before=window.as_dict())

    def _retry(self, window: WindowSummary, settings_moved: bool = False) -> bool:
        """Try a reverted change again when the conditions moved since its revert and
        it has retries left (see the module docstring). Returns whether it did."""
        assert self.config is not None
        picked = pick_retry(self.rejected, self.guard, self.config, window,
                            self._over_ceiling, settings_moved)
        if picked is not None:
            self._publish(*picked, window, "retry")
        return picked is not None
