"""Workloads for the tuning tests: the tuned nanoGPT example with the controller in
rank 0's own process (no JobMaster) and a scripted tuner that proposes a fixed list
of changes, one per window, so that switches happen at steps the ranks do not know
in advance."""

from __future__ import annotations

from dlrover_core.tuning.controller import TuningController
from dlrover_core.tuning.guard import Guard, GuardVerdict
from dlrover_core.tuning.session import ControllerSource, TuningSession
from dlrover_core.tuning.tuner import TunerBase
from examples.nanogpt.tuned_workload import TunedGPTWorkload


class ScriptedTuner(TunerBase):
    """Proposes ``plan[0]``, then ``plan[1]``, ... (one per window)."""

    defaults = {"plan": []}

    def __init__(self, options=None):
        super().__init__(options)
        self.plan = list(self.options["plan"])

    def propose(self, window, current):
        return self.plan.pop(0) if self.plan else None


class KeepEveryChange(Guard):
    """A guard that keeps every change: these tests check how the ranks switch, not
    which change pays (tests/test_tuning_guard.py checks the real guard)."""

    def judge(self, before, after):
        return GuardVerdict(True, "kept: every change is kept in this test")


class LocalTunedWorkload(TunedGPTWorkload):
    def _master_or_none(self):
        return None

    def make_tuning_session(self, initial: dict) -> TuningSession:
        self.controller, source = None, None
        if self.rank == 0:
            plan = [dict(p) for p in self.config.get("tuning_plan", [])]
            plan = [{s: dict(v) for s, v in p.items()} for p in plan]
            self.controller = TuningController(
                [("scripted", ScriptedTuner({"plan": plan}))], role=self.role,
                world_size=self.world_size, interval_steps=1, warmup_steps=0,
                guard=KeepEveryChange(windows=2))
            source = ControllerSource(self.controller, self.role)
        return TuningSession(initial, rank=self.rank, world_size=self.world_size,
                             source=source)

    def report(self, step: int, **metrics: float) -> None:
        super().report(step, **metrics)
        self.losses = getattr(self, "losses", {})
        if "loss" in metrics:
            self.losses[step] = metrics["loss"]
        if self.controller is not None:
            self.controller.on_report(self.role, self.rank, step, metrics)

    def losses_by_step(self) -> dict:
        return dict(getattr(self, "losses", {}))
