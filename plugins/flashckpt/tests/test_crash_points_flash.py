"""The crash-point harness's quick subset for the flash saver: one point per area
(save, persist, commit, prune, load), SIGKILL, 2 ranks, the persister armed for its
points (``scripts/crash_test.py --quick --savers flash``; the whole enumeration runs
in ``tests/test_crash_points.py``, marked slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_quick_subset_has_no_violation():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "crash_test.py"), "--quick",
                          "--savers", "flash"], capture_output=True, text=True, timeout=900,
                         cwd=REPO)
    # the JSON line; Ray may forward a worker's notice after it (raylet lines)
    lines = [x for x in run.stdout.strip().splitlines() if x.startswith("{")]
    assert lines, run.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["violations"] == 0, run.stdout[-6000:]
    assert run.returncode == 0 and out["runs"] > 0 and out["savers"] == ["flash"]
