"""The part of :class:`~dlrover_core.tuning.controller.TuningController` that keeps
its state in the job's store (``JobContext``, key ``tuning``, written at every change
and read back by a restarted master) and sums it up for ``summary.json``."""

from __future__ import annotations

from typing import Any

from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.tuner import TunerBase, WindowSummary

STORE_KEY = "tuning"


class ControllerState:
    """State persistence and summary of a tuning controller (a base class: the
    controller sets these attributes and implements ``current`` and
    ``_tuner_failed``)."""

    tuners: list[tuple[str, TunerBase]]
    store: Any
    config: TuningConfig | None
    previous: TuningConfig | None
    phase: str
    baseline: WindowSummary | None
    trial_changes: dict[str, dict]
    applied_step: int | None
    history: list[dict]
    rejected: list[dict]
    memory_ceiling: int | None
    windows: list[WindowSummary]
    _turn: int
    _lock: Any  # a threading.RLock

    def current(self) -> dict | None:
        raise NotImplementedError

    def _tuner_failed(self, name: str, call: str, exc: BaseException) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        return {
            "config": self.current(),
            "previous": None if self.previous is None else self.previous.to_dict(),
            "phase": self.phase,
            "baseline": None if self.baseline is None else self.baseline.as_dict(),
            "trial_changes": self.trial_changes, "applied_step": self.applied_step,
            "history": self.history, "rejected": self.rejected, "turn": self._turn,
            "memory_ceiling": self.memory_ceiling,
            "windows": [w.as_dict() for w in self.windows],
            "tuners": {n: t.state_dict() for n, t in self.tuners},
        }

    def _persist(self) -> None:
        if self.store is not None:
            self.store.set(STORE_KEY, self.state_dict())

    def _restore(self) -> None:
        state = self.store.get(STORE_KEY) if self.store is not None else None
        if not state or not state.get("config"):
            return
        self.config = TuningConfig.from_dict(state["config"])
        if state.get("previous"):
            self.previous = TuningConfig.from_dict(state["previous"])
        self.phase = state.get("phase", "baseline")
        if state.get("baseline"):
            self.baseline = WindowSummary.from_dict(state["baseline"])
        self.trial_changes = state.get("trial_changes") or {}
        self.applied_step = state.get("applied_step")
        self.history = state.get("history") or []
        self.rejected = [r for r in state.get("rejected") or [] if isinstance(r, dict)]
        self.memory_ceiling = state.get("memory_ceiling")
        self.windows = [WindowSummary.from_dict(w) for w in state.get("windows") or []]
        self._turn = int(state.get("turn", 0)) % max(1, len(self.tuners))
        for name, t in self.tuners:
            try:
                t.load_state_dict((state.get("tuners") or {}).get(name) or {})
            except Exception as exc:  # noqa: BLE001
                self._tuner_failed(name, "load_state_dict", exc)

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        """For ``summary.json``: the ``version`` and ``config`` the ranks ran last (a
        proposal or revert published but never run when the job ended is ``pending``), how many
        versions were ``proposed`` (retries included), ``retried``, ``accepted`` and
        ``reverted`` (out of memory included), the ``memory_ceiling`` (the smallest
        micro-batch that ran out of memory, or ``None``) and the ``history``."""
        with self._lock:
            return self._summary()

    def _summary(self) -> dict:
        ended, pending = self.config, None
        if (self.applied_step is None and self.previous is not None and self.config is not None
                and self.history and self.history[-1]["version"] == self.config.version):
            # proposed or reverted, never run (the job ended first): not the end
            ended, pending = self.previous, self.config
        return {
            "version": None if ended is None else ended.version,
            "config": None if ended is None else ended.to_dict(),
            "pending": None if pending is None else pending.to_dict(),
            "proposed": sum(1 for h in self.history if h["kind"] in ("proposal", "retry")),
            "retried": sum(1 for h in self.history if h["kind"] == "retry"),
            "memory_ceiling": self.memory_ceiling,
            "accepted": sum(1 for h in self.history if h.get("status") == "accepted"),
            "reverted": sum(1 for h in self.history if h.get("status") == "reverted"),
            "history": self.history,
        }

    def _is_rejected(self, settings: dict) -> bool:
        return any(r["settings"] == settings for r in self.rejected)

    def _over_ceiling(self, cfg: TuningConfig) -> bool:
        return self.memory_ceiling is not None and \
            cfg.dataloader.batch_size >= self.memory_ceiling

    def _mark(self, version: int, status: str, window: WindowSummary | None) -> None:
        for h in self.history:
            if h["version"] == version:
                h["status"] = status
                if window is not None:
                    h["samples_per_s"] = round(window.samples_per_s, 3)
