"""Learning-rate scaling when the global batch changes.

Rules (``tuning.lr_scaling``):

- ``linear``: ``lr * new / old``. The linear scaling rule of Goyal et al., "Accurate,
  Large Minibatch SGD: Training ImageNet in 1 Hour" (2017, arXiv:1706.02677), for SGD.
- ``sqrt``: ``lr * sqrt(new / old)``. Proposed by Krizhevsky, "One weird trick for
  parallelizing convolutional neural networks" (2014, arXiv:1404.5997), argued from the
  gradient noise by Hoffer, Hubara and Soudry (2017, arXiv:1705.08741), and derived for
  Adam-style optimizers by Malladi et al., "On the SDEs and Scaling Rules for Adaptive
  Gradient Algorithms" (2022, arXiv:2205.10287).
- ``none``: keep the learning rate.

Tuners that keep the global batch (micro-batch up, accumulation down) leave the
learning rate alone; the rule applies only when the global batch really changes.
"""

from __future__ import annotations

import math

LR_SCALING_RULES = ("linear", "sqrt", "none")


def scaled_learning_rate(learning_rate: float, old_global_batch: int, new_global_batch: int,
                         rule: str = "linear") -> float:
    """The learning rate for ``new_global_batch`` samples per optimizer step given
    ``learning_rate`` tuned for ``old_global_batch``.

    Raises:
        ValueError: an unknown rule, or a batch size < 1.
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"lr_scaling {rule!r} is invalid; allowed: {', '.join(LR_SCALING_RULES)}")
    if old_global_batch < 1 or new_global_batch < 1:
        raise ValueError(f"global batch sizes must be >= 1, got {old_global_batch} and "
                         f"{new_global_batch}")
    ratio = new_global_batch / old_global_batch
    if rule == "linear":
        return learning_rate * ratio
    if rule == "sqrt":
        return learning_rate * math.sqrt(ratio)
    return learning_rate
