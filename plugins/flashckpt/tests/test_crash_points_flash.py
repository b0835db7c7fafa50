"""The crash-point harness's quick subset for the flash saver: one point per area
(save, persist, commit, prune, load), SIGKILL, 2 ranks, the persister armed for its
points (``scripts/crash_test.py --quick --savers flash``; the whole enumeration runs
in ``tests/test_crash_points.py``, marked slow)."""

from __future__ import annotations

import pytest

from dlrover_core.testing.crash_harness import run_harness


@pytest.mark.slow  # 5 harness runs, ~85 s (tests/test_crash_points.py runs all points)
def test_quick_subset_has_no_violation():
    run, out = run_harness("--quick", "--savers", "flash", timeout=900)
    assert out["violations"] == 0, run.stdout[-6000:]
    assert run.returncode == 0 and out["runs"] > 0 and out["savers"] == ["flash"]
