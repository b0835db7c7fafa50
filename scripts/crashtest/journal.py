"""Ground truth of a run: each rank's journal of the operations it began and those that
returned, and the deterministic state of a rank at a step (so that a step committed by
a save that never returned still has a known expected digest)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

#: float32 elements of a rank's state (4 KiB)
STATE_ELEMENTS = 1024


def state_for(rank: int, step: int) -> dict:
    """The state a rank saves at ``step``: ``{"model": {"w", "b"}, "extra": {"n"}}``,
    4 KiB of float32 and two int64 tensors, a function of ``(rank, step)`` only."""
    import torch

    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return {"model": {"w": torch.randn(STATE_ELEMENTS, generator=g),
                      "b": torch.randint(0, 1 << 40, (8,), generator=g)},
            "extra": {"n": torch.tensor([step, rank])}}


def blank_state() -> dict:
    """A state of the same shapes as :func:`state_for`, all zeros (a load target)."""
    import torch

    return {"model": {"w": torch.zeros(STATE_ELEMENTS),
                      "b": torch.zeros(8, dtype=torch.int64)},
            "extra": {"n": torch.zeros(2, dtype=torch.int64)}}


def digest(state: dict) -> str:
    """sha256 hex of every tensor's bytes, keys in sorted order (a bit-exact compare)."""
    h = hashlib.sha256()

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k in sorted(obj):
                walk(f"{prefix}/{k}", obj[k])
        else:
            h.update(prefix.encode())
            h.update(obj.detach().cpu().contiguous().view(-1).numpy().tobytes())

    walk("", state)
    return h.hexdigest()


def expected_digest(rank: int, step: int) -> str:
    """The digest of :func:`state_for` ``(rank, step)``."""
    return digest(state_for(rank, step))


class Journal:
    """One rank's journal: one JSON line per record (with ``t``, the unix time in s),
    appended, flushed and fsynced before the operation goes on (a record survives a
    SIGKILL right after it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, **record: Any) -> None:
        """Append ``record`` durably. Raises ``OSError`` when the file cannot be written."""
        line = json.dumps({**record, "t": round(time.time(), 3)}, sort_keys=True) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> list[dict]:
        """Every record written so far (``[]`` when none)."""
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]
