"""A small synthetic stream and model for tests and smoke runs of the ``odl`` template.

:func:`toy_records` yields ``{"id": i, "x": [F floats], "y": 0/1}`` from a fixed
linear rule (seeded, so replays are identical); with ``drift_at`` the rule flips
sign there (an abrupt concept drift). :func:`endless_records` never ends.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import torch

from dlrover_plugin_odl.workloads import EvalWorkload, OnlineTrainerWorkload


def _record(rng: random.Random, i: int, w: list[float], sign: float) -> dict:
    x = [rng.gauss(0.0, 1.0) for _ in w]
    y = int(sign * sum(a * b for a, b in zip(w, x)) > 0)
    return {"id": i, "x": x, "y": y}


def toy_records(n: int = 2000, features: int = 4, seed: int = 0,
                drift_at: int | None = None) -> Iterator[dict]:
    """``n`` records of a linearly separable binary task (ids 0..n-1)."""
    rng = random.Random(seed)
    w = [rng.uniform(-1, 1) for _ in range(features)]
    for i in range(n):
        sign = -1.0 if drift_at is not None and i >= drift_at else 1.0
        yield _record(rng, i, w, sign)


def endless_records(features: int = 4, seed: int = 0) -> Iterator[dict]:
    """The same task, without end."""
    rng = random.Random(seed)
    w = [rng.uniform(-1, 1) for _ in range(features)]
    i = 0
    while True:
        yield _record(rng, i, w, 1.0)
        i += 1


def toy_model(features: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(features, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 2))


class ToyTrainer(OnlineTrainerWorkload):
    """``config.toy.features`` (4) inputs; ``config.toy.step_sleep_s`` makes each
    trainer call slower by that many seconds per step (a slow trainer, for
    backpressure)."""

    def build_model(self) -> torch.nn.Module:
        return toy_model(int(self.config.get("toy", {}).get("features", 4)))

    def train_step(self, step: int, chunk: dict | None, offsets: dict, records: int,
                   steps: int = 1, shadow: dict | None = None, save: bool = False,
                   publish: bool = False) -> dict:
        delay = float(self.config.get("toy", {}).get("step_sleep_s", 0.0))
        if delay:
            time.sleep(delay * steps)
        return super().train_step(step, chunk, offsets, records, steps, shadow, save, publish)


class ToyEval(EvalWorkload):
    def build_model(self) -> torch.nn.Module:
        return toy_model(int(self.config.get("toy", {}).get("features", 4)))
