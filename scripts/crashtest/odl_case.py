"""The ``odl`` case: the online-learning trainer's stream offsets, saved in the same
commit as its model (``extra["stream"]``), handed to the driver to commit on the
sources once the step is committed (``_newly_committed``), restored with the model
(``_restore``). Each rank drives the real :class:`OnlineTrainerWorkload` methods over
the ``disk`` saver (ranks in one gloo group, as in :mod:`.disk_case`).

The model is replicated (DDP): every rank saves the rank-0 state of the step, with the
offsets ``{"0": 10 * step}``. A load fills the harness's state with the loaded model
and ``[offset // 10, offset % 10]``, so a loaded offset that is not the step's breaks
the bit-for-bit check. A save after which ``_newly_committed`` handed offsets to the
driver journals ``acked`` (the driver acknowledges them on the source: Redis
``XACK``); a restart that resumes an older step than an acknowledged one loses the
records in between (checked in :func:`crashtest.invariants.check`)."""

from __future__ import annotations

from typing import Any

from crashtest import disk_case
from crashtest.journal import digest, state_for

NAME = "odl"
PREFIX = "odl."
DURABLE_AFTER = "save"
MODULES = ["dlrover_plugin_odl.workloads"]
TRACE_VARIANT: dict = {}
QUICK_WORLDS = (1, 2)
QUICK_FAULTS = ("sigkill",)
#: no rollback: the trainer resumes the newest commit only
FAULT_OPS: list[tuple] = [("load", None), ("save", 10), ("save", 20), ("save", 30), ("wait",),
                          ("save", 35), ("wait",), ("close",)]
setup_rank, teardown_rank = disk_case.setup_rank, disk_case.teardown_rank
committed, begin_run, pids = disk_case.committed, disk_case.begin_run, disk_case.pids
before_restart, wedged, end_run = disk_case.before_restart, disk_case.wedged, disk_case.end_run


def target(point) -> str | None:
    return None


def variants(point, fault: str, world: int, quick: bool) -> list[dict]:
    return [{}]


def nths(count: int, world: int, quick: bool) -> list[int]:
    """Every hit (4 saves at most), the first when ``quick``."""
    return list(range(1, min(count, 1 if quick else 6) + 1))


def expected_digest(rank: int, step: int) -> str:
    """Every rank holds the replicated rank-0 state of ``step``."""
    return digest(state_for(0, step))


def _model() -> Any:
    import torch

    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros_like(state_for(0, 0)["model"]["w"]))
    m.register_buffer("b", torch.zeros(8, dtype=torch.int64))
    return m


class Trainer:
    """The ODL trainer's checkpoint path, as the harness's saver."""

    def __init__(self, spec: dict) -> None:
        import torch

        from dlrover_core.checkpoint import Checkpointer
        from dlrover_plugin_odl.workloads import OnlineTrainerWorkload

        self.saver = disk_case.make_saver(spec)
        w = OnlineTrainerWorkload.__new__(OnlineTrainerWorkload)
        w._checkpointer = Checkpointer(self.saver)  # what the checkpointer property returns
        w.model = _model()
        w.optimizer = torch.optim.SGD(w.model.parameters(), lr=0.1)
        w.progress = {"step": 0, "records": 0, "offsets": {}, "prequential": {}}
        w._awaiting, w._committed_step = {}, -1
        self.w = w
        self.last_load_source: str | None = None

    def save(self, step: int) -> dict:
        import torch

        s = state_for(0, step)["model"]
        with torch.no_grad():
            self.w.model.w.copy_(s["w"])
            self.w.model.b.copy_(s["b"])
        self.w.progress = {"step": step, "records": 4 * step, "offsets": {"0": 10 * step},
                           "prequential": {}}
        self.w._save(step)
        done = self.w._newly_committed()
        if done is None:
            return {}
        if done["offsets"] != {"0": 10 * done["step"]}:
            raise AssertionError(f"offsets {done['offsets']} handed out for step {done['step']}")
        return {"acked": done["step"]}

    def load(self, state: dict) -> int | None:
        import torch

        step = self.w._restore()
        self.last_load_source = self.saver.last_load_source
        if step is not None:
            off = int(self.w.progress["offsets"]["0"])
            state["model"]["w"].copy_(self.w.model.w.detach())
            state["model"]["b"].copy_(self.w.model.b)
            state["extra"]["n"].copy_(torch.tensor([off // 10, off % 10]))
        return step

    def wait(self) -> None:
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()


def make_saver(spec: dict) -> Trainer:
    return Trainer(spec)


def save(saver: Trainer, spec: dict, step: int, state: dict) -> dict:
    return saver.save(step)


def load(saver: Trainer, spec: dict, state: dict, step: int | None) -> int | None:
    if step is not None:
        raise ValueError("the ODL trainer resumes the newest commit only")
    return saver.load(state)


def rank_report(saver: Any) -> dict:
    return {}
