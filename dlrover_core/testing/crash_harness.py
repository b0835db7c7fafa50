"""Running the crash-point harness (``scripts/crash_test.py`` of a source checkout) from a
test: the core's and the plugins' wrappers share this."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: the source checkout this package is installed from (editable installs)
REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "scripts" / "crash_test.py"


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
