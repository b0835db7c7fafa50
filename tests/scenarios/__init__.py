"""Scenarios that need a Ray cluster of their own (``ray.cluster_utils.Cluster``): each
module runs as ``python -m tests.scenarios.<name> ARGS...`` in a subprocess, so that its
cluster never meets the test session's, and prints its result as one JSON line last."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def run_scenario(name: str, *args: Any, timeout: float = 420) -> Any:
    """Run the scenario module ``tests.scenarios.<name>`` with ``args`` (as strings) and
    return its last stdout line, parsed as JSON.

    Raises:
        AssertionError: the scenario exited non-zero (the message holds the end of its
            stderr).
        subprocess.TimeoutExpired: it ran longer than ``timeout`` seconds.
    """
    out = subprocess.run([sys.executable, "-m", f"tests.scenarios.{name}", *map(str, args)],
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
