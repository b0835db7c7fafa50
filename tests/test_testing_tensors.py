"""``dlrover_core.testing``'s state-dict helpers: what ``flatten_state`` keeps of each
leaf, and that ``assert_states_equal`` fails on a difference it names."""

from __future__ import annotations

import pickle

import pytest
import torch

from dlrover_core.testing import assert_states_equal, flatten_state


class _Scaler:  # an object compared by identity, as DeepSpeed's loss scaler
    cur_scale = 1.0


def test_flatten_state_keeps_values_clones_tensors_and_names_other_objects():
    t = torch.arange(3.0)
    flat = flatten_state({"w": t, "opt": [{"betas": (0.9, 0.99), "fused": None}],
                          "dtype": torch.bfloat16, "scaler": _Scaler()})
    assert sorted(flat) == [".dtype", ".opt.0.betas.0", ".opt.0.betas.1", ".opt.0.fused",
                            ".scaler", ".w"]
    assert torch.equal(flat[".w"], t) and flat[".w"].data_ptr() != t.data_ptr()
    assert (flat[".opt.0.betas.1"], flat[".opt.0.fused"]) == (0.99, None)
    assert flat[".dtype"] is torch.bfloat16
    assert flat[".scaler"] == f"<{__name__}._Scaler>"
    # what a round trip through another process (pickling) gives compares equal
    assert_states_equal([pickle.loads(pickle.dumps(flat))], [flat])


def test_assert_states_equal_names_the_rank_and_path_that_differ():
    a = flatten_state({"w": torch.zeros(2), "step": 3})
    b = flatten_state({"w": torch.zeros(2, dtype=torch.float64), "step": 3})
    with pytest.raises(AssertionError, match=r"\(0, '.w'\)"):
        assert_states_equal([a], [b])
    with pytest.raises(AssertionError, match=r"\(0, '.step'\)"):
        assert_states_equal([a], [{**a, ".step": 4}])
