"""The online model of the Shuttle stream: a 2-layer MLP on signed-log features.

The preprocessing is stateless (``sign(x) * log1p(|x|)`` per attribute: the raw
values span -26,739 .. 15,164), so any preprocess instance can take any chunk.
"""

from __future__ import annotations

import torch
from dlrover_plugin_odl.workloads import (
    EvalWorkload,
    OnlineTrainerWorkload,
    PreprocessWorkload,
)

from examples.odl_shuttle.data import FEATURES


def features(rows: list[list[float]]) -> torch.Tensor:
    """Raw attributes ``[N, 9]`` -> float32 ``sign(x) * log1p(|x|)``."""
    x = torch.tensor(rows, dtype=torch.float32)
    return torch.sign(x) * torch.log1p(x.abs())


def build_model(hidden: int = 32) -> torch.nn.Module:
    """Logits ``[N, 2]`` from features ``[N, 9]``."""
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 2))


class ShuttlePreprocess(PreprocessWorkload):
    def transform(self, records: list[dict]) -> dict[str, torch.Tensor]:
        return {"x": features([r["x"] for r in records]),
                "y": torch.tensor([int(r["y"]) for r in records], dtype=torch.int64)}


class ShuttleTrainer(OnlineTrainerWorkload):
    def build_model(self) -> torch.nn.Module:
        torch.set_num_threads(1)
        return build_model(int(self.config.get("hidden", 32)))


class ShuttleEval(EvalWorkload):
    def build_model(self) -> torch.nn.Module:
        torch.set_num_threads(1)
        return build_model(int(self.config.get("hidden", 32)))
