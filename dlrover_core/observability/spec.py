"""Validation of the job spec's ``observability`` section (called by the spec loader,
in the client, before anything starts). Every error is a ``SpecError`` naming the
dotted key, the bad value and what is allowed."""

from __future__ import annotations

import importlib.util
from typing import Any

from dlrover_core.spec.errors import SpecError


def validate_observability(spec: Any) -> None:
    """Check ``spec.observability``: ``tensorboard`` is ``true``, ``false`` or a directory
    (and torch and the ``tensorboard`` package are installed when it is on). The worker
    logs' ``log_max_bytes`` (>= ``MIN_LOG_BYTES``) and ``log_backups`` (>= 0), the limits
    of :class:`~dlrover_core.runtime.log_capture.RotatingFile`, are declared on
    ``ObservabilitySpec`` and checked with the rest of the schema.

    Raises:
        SpecError: a bad value, or ``tensorboard`` on without torch or the tensorboard
            package.
    """
    tb = spec.observability.tensorboard
    if not (isinstance(tb, bool) or (isinstance(tb, str) and tb.strip())):
        raise SpecError("observability.tensorboard", tb,
                        "true (event files in <job_dir>/tensorboard), false, or a directory")
    missing = [m for m in ("tensorboard", "torch") if importlib.util.find_spec(m) is None]
    if tb is not False and missing:
        raise SpecError("observability.tensorboard", tb, "false, or install torch and the "
                        "tensorboard package: pip install 'dlrover-core[tensorboard]'",
                        f"not installed: {', '.join(missing)}")
