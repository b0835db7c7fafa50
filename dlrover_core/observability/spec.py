"""Validation of the job spec's ``observability`` section (called by the spec loader,
in the client, before anything starts). Every error is a ``SpecError`` naming the
dotted key, the bad value and what is allowed."""

from __future__ import annotations

import importlib.util
from typing import Any

from dlrover_core.spec.errors import SpecError


def validate_observability(spec: Any) -> None:
    """Check ``spec.observability.tensorboard``: ``true``, ``false`` or a directory, and
    the ``tensorboard`` package installed when it is on.

    Raises:
        SpecError: a bad value, or ``tensorboard`` on without the tensorboard package.
    """
    tb = spec.observability.tensorboard
    if not (isinstance(tb, bool) or (isinstance(tb, str) and tb.strip())):
        raise SpecError("observability.tensorboard", tb,
                        "true (event files in <job_dir>/tensorboard), false, or a directory")
    if tb is not False and importlib.util.find_spec("tensorboard") is None:
        raise SpecError("observability.tensorboard", tb, "false, or install the tensorboard "
                        "package: pip install 'dlrover-core[tensorboard]'",
                        "the tensorboard package is not installed")
