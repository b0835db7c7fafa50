"""The online model of the Shuttle stream: a 2-layer MLP on signed-log features.

The preprocessing is stateless (``sign(x) * log1p(|x|)`` per attribute: the raw
values span -26,739 .. 15,164), so any preprocess instance can take any chunk.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from dlrover_plugin_odl.workloads import (
    EvalWorkload,
    OnlineTrainerWorkload,
    PreprocessWorkload,
)

from examples.odl_shuttle.data import FEATURES


def features(rows: Any) -> torch.Tensor:
    """Raw attributes ``[N, 9]`` (a NumPy array or a list of lists) -> float32
    ``sign(x) * log1p(|x|)``."""
    x = torch.as_tensor(np.asarray(rows, dtype=np.float32))
    return torch.sign(x) * torch.log1p(x.abs())


def build_model(hidden: int = 32) -> torch.nn.Module:
    """Logits ``[N, 2]`` from features ``[N, 9]``."""
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 2))


class ShuttlePreprocess(PreprocessWorkload):
    def transform_columns(self, columns: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"x": features(columns["x"]),
                "y": torch.as_tensor(np.asarray(columns["y"], dtype=np.int64))}


class ShuttleTrainer(OnlineTrainerWorkload):
    def build_model(self) -> torch.nn.Module:
        torch.set_num_threads(1)
        return build_model(int(self.config.get("hidden", 32)))


class ShuttleEval(EvalWorkload):
    def build_model(self) -> torch.nn.Module:
        torch.set_num_threads(1)
        return build_model(int(self.config.get("hidden", 32)))
