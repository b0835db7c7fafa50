"""Elastic roles in the spec: ``roles.R.nodes`` as torchrun's MIN:MAX and the
``elastic`` section; every bad value is named with what is allowed."""

from __future__ import annotations

import pytest

from dlrover_core import SpecError, load_spec
from dlrover_core.spec.elastic import node_range, parse_nodes

W = "examples.nanogpt.workload:GPTWorkload"


def spec(nodes, total=2, per_node=1, **extra):
    return {"name": "t", "roles": {"trainer": {"workload": W, "total": total,
                                               "per_node": per_node, "backend": "ddp",
                                               "nodes": nodes}}, **extra}


def test_ranges_parse_like_torchrun():
    assert parse_nodes("1:4") == (1, 4)
    assert parse_nodes(" 2 : 3 ") == (2, 3)
    assert parse_nodes("3") == (3, 3) == parse_nodes(3)
    assert parse_nodes({"min": 1, "max": 2}) == (1, 2)
    s = load_spec(spec("1:4", total=4, per_node=2), ["elastic.replacement_timeout_s=5"])
    r = node_range(s, "trainer")
    assert (r.min_nodes, r.max_nodes, r.min_ranks, r.max_ranks) == (1, 4, 2, 8)
    assert s.elastic.replacement_timeout_s == 5 and s.elastic.poll_interval_s == 5
    assert node_range(load_spec(spec(None)), "trainer") is None


@pytest.mark.parametrize("nodes, match", [
    ("4:1", r"roles.trainer.nodes: '4:1' is invalid \(MIN 4 > MAX 1\); allowed: 'MIN:MAX'"),
    ("0:2", r"roles.trainer.nodes: '0:2' is invalid; allowed: .* with MIN >= 1"),
    ("1-4", r"roles.trainer.nodes: '1-4' is invalid; allowed: 'MIN:MAX'"),
    ({"min": 1}, r"a mapping needs exactly min and max"),
    (64, r"roles.trainer.total: 2 is invalid; allowed: .*quote it"),
])
def test_bad_ranges(nodes, match):
    with pytest.raises(SpecError, match=match):
        load_spec(spec(nodes))


def test_total_must_be_in_range_and_the_role_elastic_capable():
    with pytest.raises(SpecError, match=r"roles.trainer.total: 6 is invalid; allowed: k x "
                                        r"per_node=2 for k in nodes 1..2: 2, 4"):
        load_spec(spec("1:2", total=6, per_node=2))
    with pytest.raises(SpecError, match="roles.trainer.per_node: 0 is invalid"):
        load_spec(spec("1:2", per_node=0))
    bad = spec("1:2")
    bad["roles"]["trainer"]["backend"] = None
    with pytest.raises(SpecError, match="only on a role with a backend"):
        load_spec(bad)
    with pytest.raises(SpecError, match="elastic.poll_interval_s: 0"):
        load_spec(spec("1:2"), ["elastic.poll_interval_s=0"])
    with pytest.raises(SpecError, match="elastic.replacement_timeout_s: -1"):
        load_spec(spec("1:2"), ["elastic.replacement_timeout_s=-1"])
    with pytest.raises(SpecError, match="both elastic.global_batch and elastic.micro_batch"):
        load_spec(spec("1:2"), ["elastic.global_batch=8"])
    with pytest.raises(SpecError, match=r"elastic.global_batch: 6 is invalid; allowed: a "
                                        r"multiple of elastic.micro_batch x roles.trainer.total"):
        load_spec(spec("1:2"), ["elastic.global_batch=6", "elastic.micro_batch=2"])
