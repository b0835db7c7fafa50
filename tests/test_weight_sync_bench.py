"""``benchmarks/weight_sync.py`` without a cluster: its model splits the size into
tensors of the asked size, and bad options name the option, the value and what is
allowed."""

from __future__ import annotations


import pytest

from tests.script_files import load_script

@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("dlrover_plugin_ppo")
    return load_script("benchmarks/weight_sync.py", "weight_sync_bench")


def test_model_holds_the_size_in_tensors_of_the_asked_size(bench):
    m = bench.Blob(10 * 4, 4 * 4)  # 10 float32 in tensors of at most 4
    assert [p.numel() for p in m.parameters()] == [4, 4, 2]
    assert sum(v.nbytes for v in m.state_dict().values()) == 40


def test_spread_of_the_repetitions(bench):
    assert bench.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


@pytest.mark.parametrize("argv", [["--sizes-mib", "0"], ["--workers", "-1"],
                                  ["--repetitions", "x"]])
def test_bad_options_name_option_value_and_allowed(bench, argv, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    err = capsys.readouterr().err
    assert f"{argv[0]}={argv[1]!r}" in err and "allowed: a number > 0" in err
