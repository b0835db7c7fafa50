"""The crash-point harness's quick subset for the flash saver: one point per area
(save, persist, commit, prune, load), SIGKILL, 2 ranks, the persister armed for its
points (``scripts/crash_test.py --quick --savers flash``; the whole enumeration runs
in ``tests/test_crash_points.py``, marked slow)."""

from __future__ import annotations

import pytest

from dlrover_core.testing.crash_harness import SKIP_QUICK, run_harness


@pytest.mark.slow  # 5 harness runs, ~85 s (tests/test_crash_points.py runs all points)
@SKIP_QUICK
def test_quick_subset_has_no_violation():
    run, out = run_harness("--quick", "--savers", "flash", timeout=900)
    assert out["violations"] == 0, run.stdout[-6000:]
    assert run.returncode == 0 and out["runs"] > 0 and out["savers"] == ["flash"]


def test_the_rollback_target_is_persisted_before_a_newer_save():
    """The fault phase's rollback ``load(N)`` must read N from shared memory in every
    fault-free run, or the memory load's points go unreached (tested vacuously) on a
    loaded machine: with 2 buffers and saves that never wait, a newer save replaces N
    when N still waits for a persister busy with an older step. So N's save is followed
    by a ``wait`` before the next save (fails with :data:`crashtest.plan.FAULT_OPS`)."""
    import sys

    from dlrover_core.testing.crash_harness import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from crashtest import flash_case
    finally:
        sys.path.remove(str(REPO / "scripts"))
    ops = flash_case.FAULT_OPS
    rollbacks = [op[1] for op in ops if op[0] == "load" and op[1] is not None]
    assert rollbacks, ops
    for n in rollbacks:
        i = ops.index(("save", n))
        after = [op[0] for op in ops[i + 1:ops.index(("load", n))]]
        assert "wait" in after and after.index("wait") < (after + ["save"]).index("save"), \
            (n, ops)
