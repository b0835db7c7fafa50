"""Run-time straggler detection from the ranks' step reports.

In a synchronous SPMD job every rank takes the same wall time per step: a slow rank
makes the others wait for it inside the collectives. So the time of a step is split
into the rank's own work and its waiting: ``compute_s`` (the rank's own work,
:mod:`dlrover_core.tuning.metrics`; a report without it uses ``step_s``) and
``wait_s``: the rank's measured collective wait ``comm_wait_s`` where it reports one
(DDP's gradient all-reduce, timed by the ``ddp`` backend's hook on every rank: from its
arrival with its last gradients to the all-reduce's completion), else ``step_s -
compute_s`` (data, collectives, the rest). A straggler has a large ``compute_s`` and a
small ``wait_s``; its peers the opposite.

Every ``node_health.straggler_window_s`` seconds (master clock) a window closes: for
each role, each rank's median ``compute_s`` and ``wait_s`` over its reports in the
window are compared with the medians of the other ranks' medians; a rank whose
``compute_s`` is above ``straggler_factor`` times the others' and whose ``wait_s`` is
not above the others' (when every rank has one: a rank that waits more than its peers
is not what they wait for) is slow in this window. Slow in
``straggler_windows`` windows in a row, it is a straggler: ``straggler_detected``
(with every window's per-rank medians as evidence) and the
``node_health.straggler_action``: ``report`` (the event only; reported again only
after it was not slow for a window), ``replace`` (a ``straggler`` failure of that
rank: the failover policy restarts it at ``process`` level, from the warm standby
when there is one, counting against ``failover.max_restarts``) or ``shrink`` (the same
failure, recovered by ``master.elastic``: the straggler's node is dropped from its
elastic role; when the role is at its minimum, ``report`` instead, and the event
names ``configured_action`` and ``fallback_reason``). A window that a
recovery overlaps is dropped, and so are the streaks.

Non-zero ranks coalesce their reports (``runtime.reporting``: the newest step at most
every 0.5 s or more), so a window needs to be a few report intervals long.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import TYPE_CHECKING

from dlrover_core.master.elastic_room import straggler_shrink_target
from dlrover_core.master.instances import InstanceState
from dlrover_core.master.monitor import Detection
from dlrover_core.plugins.records import Failure, FailureKind

if TYPE_CHECKING:
    from dlrover_core.master.scope import JobScope


def window_medians(samples: dict[int, list[tuple[float, float | None]]]) -> dict[int, dict]:
    """rank -> ``{"compute_s", "wait_s", "reports"}``: the medians of one window's
    ``(compute_s, wait_s)`` samples (``wait_s`` ``None`` when no report had it)."""
    out = {}
    for rank, xs in samples.items():
        if not xs:
            continue
        waits = [w for _, w in xs if w is not None]
        out[rank] = {"compute_s": statistics.median(c for c, _ in xs),
                     "wait_s": statistics.median(waits) if waits else None,
                     "reports": len(xs)}
    return out


def slow_ranks(medians: dict[int, dict], factor: float) -> dict[int, float]:
    """rank -> its ratio to the median of the other ranks' ``compute_s``, for the ranks
    above ``factor`` whose ``wait_s`` is not above the median of the other ranks'
    ``wait_s`` (that test only when every rank has a ``wait_s``; needs two ranks or
    more)."""
    out = {}
    if len(medians) < 2:
        return out
    waits_known = all(m.get("wait_s") is not None for m in medians.values())
    for rank, m in medians.items():
        others = statistics.median(o["compute_s"] for r, o in medians.items() if r != rank)
        if not (others > 0 and m["compute_s"] > factor * others):
            continue
        if waits_known and m["wait_s"] > statistics.median(
                o["wait_s"] for r, o in medians.items() if r != rank):
            continue  # it waits more than its peers: they do not wait for it
        out[rank] = m["compute_s"] / others
    return out


class StragglerDetector:
    """Collects the step reports (:meth:`on_report`, the report thread) and judges
    closed windows (:meth:`check`, the controller's loop)."""

    def __init__(self, scope: JobScope) -> None:
        self.scope = scope
        self._lock = threading.Lock()
        #: role -> rank -> (compute_s, wait_s) of the open window
        self._samples: dict[str, dict[int, list[tuple[float, float | None]]]] = {}
        self._window_start = time.time()
        #: (role, rank) -> evidence of its consecutive slow windows
        self._streak: dict[tuple[str, int], list[dict]] = {}
        self._reported: set[tuple[str, int]] = set()

    @property
    def action(self) -> str:
        return str(self.scope.spec.node_health.straggler_action)

    def on_report(self, role: str, rank: int, step: int, metrics: dict) -> None:
        """A step report (``metrics`` name -> float, seconds)."""
        if self.action == "off":
            return
        busy = metrics.get("compute_s", metrics.get("step_s"))
        if not isinstance(busy, (int, float)):
            return
        wait = None
        if isinstance(metrics.get("comm_wait_s"), (int, float)):
            wait = float(metrics["comm_wait_s"])
        elif "compute_s" in metrics and isinstance(metrics.get("step_s"), (int, float)):
            wait = max(0.0, float(metrics["step_s"]) - float(busy))
        with self._lock:
            self._samples.setdefault(role, {}).setdefault(rank, []).append((float(busy), wait))

    def check(self, now: float | None = None) -> Detection | None:
        """Close the window when it is due and judge it; a ``Detection`` of the
        straggler when the action is ``replace``, else ``None``."""
        nh = self.scope.spec.node_health
        if self.action == "off":
            return None
        now = time.time() if now is None else now
        window_s = float(nh.straggler_window_s)
        if now - self._window_start < window_s:
            return None
        with self._lock:
            samples, self._samples = self._samples, {}
        started, self._window_start = self._window_start, now
        if self.scope.failover.last_recovery_end >= started:  # a recovery in the window
            self._streak.clear()
            return None
        found = None
        for role, by_rank in sorted(samples.items()):
            medians = window_medians(by_rank)
            slow = slow_ranks(medians, float(nh.straggler_factor))
            for rank in medians:
                key = (role, rank)
                if rank not in slow:
                    self._streak.pop(key, None)
                    self._reported.discard(key)
                    continue
                window = {"start": round(started, 3), "ratio": round(slow[rank], 3),
                          "ranks": {str(r): {k: (round(v, 5) if isinstance(v, float) else v)
                                             for k, v in m.items()}
                                    for r, m in sorted(medians.items())}}
                self._streak.setdefault(key, []).append(window)
                streak = self._streak[key]
                if len(streak) >= int(nh.straggler_windows) and key not in self._reported:
                    det = self._detected(role, rank, streak[-int(nh.straggler_windows):])
                    found = found or det
        return found

    def _detected(self, role: str, rank: int, evidence: list[dict]) -> Detection | None:
        s, nh = self.scope, self.scope.spec.node_health
        inst = s.instances.get(role, rank)
        self._reported.add((role, rank))
        self._streak.pop((role, rank), None)
        ratio = evidence[-1]["ratio"]
        action, extra = self.action, {}
        if action == "shrink":  # at the role's minimum (or not elastic): report, say why
            target, why = straggler_shrink_target(s, role)
            action, extra = ("shrink", {"target_world_size": target}) if target else \
                ("report", {"configured_action": "shrink", "fallback_reason": why})
        s.emit("straggler_detected", role=role, rank=rank,
               node_id=inst.node_id if inst else "", pid=inst.pid if inst else 0,
               step=inst.last_step if inst else -1, ratio=ratio,
               factor=float(nh.straggler_factor), windows=len(evidence),
               window_s=float(nh.straggler_window_s), action=action, evidence=evidence,
               **extra)
        if action not in ("replace", "shrink") or inst is None or \
                inst.state != InstanceState.RUNNING:
            return None
        message = (f"compute_s {ratio:.2f}x the median of the other ranks (its wait no "
                   f"longer than theirs) for "
                   f"{len(evidence)} windows of {float(nh.straggler_window_s):g} s "
                   f"(straggler_factor={float(nh.straggler_factor):g})")
        return Detection(inst, Failure(FailureKind.STRAGGLER, role, rank, inst.node_id,
                                       "Straggler", message, "", "run", inst.last_step,
                                       inst.attempt))
