from dlrover_core.testing import *  # noqa: F401,F403


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests (megatron-core's GPTModel) need CUDA; skip them without it."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (megatron-core GPTModel)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
