"""Per-rank seeds the way Megatron-LM sets them.

Megatron-LM's training setup (``megatron/training/initialize.py``, ``_set_random_seed``)
offsets the base seed by the pipeline stage, ``seed + 100 * pp_rank`` (and by
``10 * dp_rank`` with ``--data-parallel-random-init``), seeds ``random``, NumPy and
torch with it, and on a GPU hands it to megatron-core's
``tensor_parallel.model_parallel_cuda_manual_seed``, which sets up the CUDA RNG
tracker: the default CUDA state equal across a tensor-parallel group and a
``model-parallel-rng`` state (``seed + 2718 + tp_rank``) for dropout inside
tensor-parallel regions. Without CUDA there is no tracker; the CPU generator is
seeded with the same offsets.
"""

from __future__ import annotations

import random


def rank_seed(seed: int, pp_rank: int, dp_rank: int = 0,
              data_parallel_random_init: bool = False) -> int:
    """The seed of one rank: ``seed + 100 * pp_rank (+ 10 * dp_rank)``.

    Ranks of one tensor-parallel group get the same seed, so replicated parameters
    (layer norms, biases of row-parallel layers) start equal on all of them.
    """
    s = seed + 100 * pp_rank
    if data_parallel_random_init:
        s += 10 * dp_rank
    return s


def seed_rank(seed: int, data_parallel_random_init: bool = False) -> int:
    """Seed ``random``, NumPy, torch (and on a GPU the TP-region RNG tracker) for this
    rank from ``parallel_state``; returns the seed used. Call after the model-parallel
    groups exist."""
    import numpy as np
    import torch
    from megatron.core import parallel_state as ps

    s = rank_seed(seed, ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(),
                  data_parallel_random_init)
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(s)
    return s
