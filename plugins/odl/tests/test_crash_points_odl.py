"""The crash-point harness's quick subset for the ODL trainer's offsets: each odl.*
point, SIGKILL, 1 and 2 ranks (``scripts/crash_test.py --quick --savers odl``; the
whole enumeration runs in ``tests/test_crash_points.py``, marked slow)."""

from __future__ import annotations

from dlrover_core.testing.crash_harness import SKIP_QUICK, run_harness


@SKIP_QUICK
def test_quick_subset_has_no_violation():
    run, out = run_harness("--quick", "--savers", "odl", timeout=900)
    assert out["violations"] == 0, run.stdout[-6000:]
    assert run.returncode == 0 and out["runs"] > 0 and out["savers"] == ["odl"]
