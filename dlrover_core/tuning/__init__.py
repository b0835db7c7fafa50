"""Online tuning: metrics, the versioned ``TuningConfig``, ``ElasticDataLoader``, tuners.

Light to import (no torch): the pieces that need torch import it inside.
See docs/tuning.md for the loop.
"""

from __future__ import annotations

from dlrover_core.tuning.accumulation import grad_accum_steps_for, gradient_sync
from dlrover_core.tuning.config import TuningConfig, TuningConfigError
from dlrover_core.tuning.dataloader import ElasticDataLoader
from dlrover_core.tuning.guard import Guard
from dlrover_core.tuning.lr_scaling import LR_SCALING_RULES, scaled_learning_rate
from dlrover_core.tuning.metrics import StepTimer, measure_comm_wait
from dlrover_core.tuning.parallelism import ActivationCheckpointing, apply_parallelism
from dlrover_core.tuning.session import TuningSession
from dlrover_core.tuning.tuner import TunerBase, WindowSummary

__all__ = ["ActivationCheckpointing", "ElasticDataLoader", "Guard", "LR_SCALING_RULES",
           "StepTimer", "TunerBase", "TuningConfig", "TuningConfigError", "TuningSession",
           "WindowSummary", "apply_parallelism", "grad_accum_steps_for", "gradient_sync",
           "measure_comm_wait", "scaled_learning_rate"]
