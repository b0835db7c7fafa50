"""The disk saver after a rollback (``load(step=N)`` of an older step): the first save sets
the steps above N aside, so a restart and ``keep`` follow the new history; a crash or an
I/O error while it does so is finished by the next listing. Found by the crash-point
harness (107 violations: a restart resumed the abandoned 30 after a rollback to 20 and a
commit of 25; the prune by step number kept 30 and deleted 20 or 25)."""

from __future__ import annotations

import os

import pytest
import torch

from dlrover_core import crashpoints
from dlrover_core.checkpoint import SaverConfig, SaverContext
from dlrover_core.checkpoint.disk import DiskSaver


def saver(d: str, keep: int = 3) -> DiskSaver:
    return DiskSaver(SaverConfig(dir=d, keep=keep), SaverContext())


def state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": torch.tensor(step)}


def test_a_rollback_sets_the_abandoned_steps_aside_at_the_first_save(tmp_path):
    d = str(tmp_path / "ck")
    s = saver(d)
    for step in (10, 20, 30):
        s.save(step, state(step))
    got = state(-1)
    assert s.load(got, step=20) == 20 and torch.equal(got["w"], state(20)["w"])
    assert s.committed_steps() == [10, 20, 30]  # a load alone changes nothing
    s.save(25, state(25))
    assert s.committed_steps() == [10, 20, 25]
    assert os.path.isdir(os.path.join(d, "step_00000030.abandoned"))
    s.save(35, state(35))
    assert s.committed_steps() == [20, 25, 35]  # keep=3 of the new history
    got = state(-1)
    assert saver(d).load(got) == 35 and torch.equal(got["w"], state(35)["w"])


@pytest.mark.parametrize("point", ["disk.rollback.marker", "disk.rollback.abandon"])
def test_a_rollback_cut_short_is_finished_or_never_started(tmp_path, point):
    """EIO at the marker's write (nothing changed: the old history stands whole) or at
    the first rename (the marker is there: the next load finishes the rollback and
    resumes the base, 20, never the abandoned 30)."""
    d = str(tmp_path / "ck")
    s = saver(d)
    for step in (10, 20, 30):
        s.save(step, state(step))
    assert s.load(state(-1), step=20) == 20
    crashpoints.arm(point, "eio")
    try:
        with pytest.raises(OSError):
            s.save(25, state(25))
    finally:
        crashpoints.arm(None)
    got = state(-1)
    want = 30 if point == "disk.rollback.marker" else 20
    assert saver(d).load(got) == want and torch.equal(got["w"], state(want)["w"])
    assert not os.path.exists(os.path.join(d, "rollback.json"))
