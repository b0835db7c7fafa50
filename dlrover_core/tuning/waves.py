"""Loader waves: how many steps a measurement window and a warm-up span.

``num_workers`` DataLoader workers start together after each switch and each builds a
whole micro-batch, so an input-bound loader delivers batches in waves of
``num_workers``; a step takes ``grad_accum_steps`` micro-batches. A window that holds a
whole number of waves holds the same share of the stalls between waves as the next
one; the first wave after a switch is the loader's refill (the workers start and each
reads a whole micro-batch).
"""

from __future__ import annotations

import math
from typing import Any


def wave_steps(num_workers: int, grad_accum_steps: int) -> int:
    """Optimizer steps that hold a whole number of waves:
    ``num_workers / gcd(num_workers, grad_accum_steps)``; 1 with at most one worker."""
    workers, accum = int(num_workers), max(1, int(grad_accum_steps))
    return workers // math.gcd(workers, accum) if workers > 1 else 1


def _loader(config: Any) -> tuple[int, int]:
    """``(num_workers, grad_accum_steps)`` of a ``TuningConfig``."""
    return int(config.dataloader.num_workers), max(1, int(config.optimizer.grad_accum_steps))


def window_steps(interval_steps: int, config: Any) -> int:
    """Steps per measurement window under ``config`` (a ``TuningConfig``):
    ``interval_steps`` rounded up to a multiple of :func:`wave_steps`."""
    wave = wave_steps(*_loader(config))
    return -(-int(interval_steps) // wave) * wave


def warmup_steps(base: int, config: Any) -> int:
    """Steps to skip after a switch to ``config``: ``base``, and at least the steps that
    consume the first wave, ``ceil(num_workers / grad_accum_steps)`` (0 with at most one
    worker)."""
    workers, accum = _loader(config)
    return max(int(base), -(-workers // accum) if workers > 1 else 0)
