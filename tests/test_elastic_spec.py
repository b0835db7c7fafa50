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
    with pytest.raises(SpecError, match="elastic.placement_timeout_s: 0"):
        load_spec(spec("1:2"), ["elastic.placement_timeout_s=0"])


def test_global_batch_reaches_the_context_at_every_world_size():
    from dlrover_core.runtime.context import WorkerContext

    def ctx(world):
        return WorkerContext(job="j", role="trainer", rank=0, world_size=world, local_rank=0,
                             local_world_size=1, global_batch=24, micro_batch=4)

    # a resize changes only the world size: the accumulation steps follow it
    assert [ctx(w).grad_accum_steps for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    env = ctx(2).env()
    assert (env["DLROVER_GLOBAL_BATCH"], env["DLROVER_MICRO_BATCH"],
            env["DLROVER_GRAD_ACCUM_STEPS"]) == ("24", "4", "3")
    with pytest.raises(ValueError, match=r"elastic.global_batch=24 is not a multiple of "
                                         r"elastic.micro_batch=4 x world_size=4 of role "
                                         r"'trainer'"):
        ctx(4)
    plain = WorkerContext(job="j", role="t", rank=0, world_size=3, local_rank=0,
                          local_world_size=1)
    assert plain.grad_accum_steps == 0 and "DLROVER_GRAD_ACCUM_STEPS" not in plain.env()


def test_global_batch_must_split_on_every_role_with_a_backend():
    s = {"name": "t", "roles": {"trainer": {"workload": W, "total": 5, "backend": "ddp"},
                                "other": {"workload": W, "total": 5}},  # no backend: no check
         "elastic": {"global_batch": 24, "micro_batch": 4}}
    with pytest.raises(SpecError, match=r"elastic.global_batch: 24 is invalid; allowed: a "
                                        r"multiple of elastic.micro_batch x "
                                        r"roles.trainer.total = 4 x 5"):
        load_spec(s)
    s["roles"]["trainer"]["total"] = 3
    assert load_spec(s).elastic.global_batch == 24
