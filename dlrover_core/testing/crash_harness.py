"""Running the crash-point harness (``scripts/crash_test.py`` of a source checkout) from a
test: the core's and the plugins' wrappers share this (test code: it imports pytest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: the source checkout this package is installed from (editable installs)
REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "scripts" / "crash_test.py"


#: the mark of a quick subset's test (the tests' module: pytest is there): skipped when
#: ``SLOW=1``, where the whole enumeration runs
SKIP_QUICK = pytest.mark.skipif(
    os.environ.get("SLOW") == "1",
    reason="SLOW=1 (make test SLOW=1, CI) runs the whole enumeration "
           "(tests/test_crash_points.py), which holds every run of each quick subset "
           "(test_each_quick_subset_is_a_part_of_the_whole_enumeration)")


def run_harness(*args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the harness with ``args`` in the checkout; ``(process, its JSON line)``: the last
    line that is a JSON object (Ray may forward a worker's notice after it).

    Raises:
        AssertionError: it printed no JSON line (its stderr's end in the message).
        subprocess.TimeoutExpired: it ran past ``timeout`` s.
    """
    run = subprocess.run([sys.executable, str(HARNESS), *args], capture_output=True,
                         text=True, timeout=timeout, cwd=REPO)
    lines = [x for x in run.stdout.strip().splitlines() if x.startswith("{")]
    assert lines, run.stderr[-3000:]
    return run, json.loads(lines[-1])
