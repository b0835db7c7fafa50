"""Job spec validation: every bad input gets an error naming the key, the value and
what is allowed, before anything starts."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from dlrover_core import DLJobBuilder, SpecError, load_spec

W = "examples.nanogpt.workload:GPTWorkload"


def base(**extra):
    spec = {"name": "t", "template": "sft",
            "roles": {"trainer": {"workload": W, "total": 2, "per_node": 2, "backend": "fsdp"}}}
    spec.update(extra)
    return spec


def test_valid_yaml_with_overrides(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(OmegaConf.to_yaml(base(config={"lr": 0.1})))
    spec = load_spec(str(p), ["roles.trainer.total=4", "config.lr=0.5", "+config.new=1"])
    assert spec.roles.trainer.total == 4
    assert spec.config.lr == 0.5 and spec.config.new == 1
    assert spec.checkpoint.saver == "disk"  # schema default
    assert spec.edges == []  # sft's trainer->eval edge only when eval exists


def test_unknown_key():
    with pytest.raises(SpecError) as e:
        load_spec(base(roles={"trainer": {"workload": W, "totl": 2}}))
    msg = str(e.value)
    assert "roles.trainer.totl" in msg and "unknown key" in msg
    assert "allowed: one of: workload, total, per_node" in msg


def test_unknown_top_level_key_in_override():
    for item in ("placment=spread", "+placment=spread"):  # '+' cannot add to the schema
        with pytest.raises(SpecError, match=r"placment.*unknown key in the overrides; did you "
                                            r"mean 'placement'\?.*allowed: one of: name, "
                                            r"template"):
            load_spec(base(), [item])


def test_override_of_a_key_the_file_lacks_is_an_error_with_the_nearest_key(tmp_path):
    """Hydra's rule: `key=value` changes a key the file has; a typo is not a new key."""
    p = tmp_path / "job.yaml"
    p.write_text(OmegaConf.to_yaml(base(config={"max_steps": 400, "lr": 0.1})))
    with pytest.raises(SpecError) as e:
        load_spec(str(p), ["config.max_step=60"])
    msg = str(e.value)
    assert msg.startswith("config.max_step: '60' is invalid")
    assert "did you mean 'max_steps'?" in msg and "+config.max_step=60 to add it" in msg
    with pytest.raises(SpecError, match=r"no key 'trainr' at 'roles'; did you mean 'trainer'"):
        load_spec(str(p), ["roles.trainr.total=4"])
    with pytest.raises(SpecError, match=r"no key 'x' at 'config.lr'"):
        load_spec(str(p), ["config.lr.x=1"])  # below a value: nothing to change


def test_plus_adds_a_key_and_double_plus_sets_either_way(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(OmegaConf.to_yaml(base(config={"max_steps": 400})))
    spec = load_spec(str(p), ["+config.new_key=7", "config.new_key=8", "+config.fault.rank=1",
                              "++config.max_steps=60", "++config.other=x"])
    assert spec.config.new_key == 8 and spec.config.fault.rank == 1
    assert spec.config.max_steps == 60 and spec.config.other == "x"
    with pytest.raises(SpecError, match=r"\+config.max_steps adds a key, but .* has it.*"
                                        r"write config.max_steps=60 to change it"):
        load_spec(str(p), ["+config.max_steps=60"])
    # a key the file does not set but the schema has (issue 52 item 5): the error says so
    with pytest.raises(SpecError) as e:
        load_spec(str(p), ["+observability.tensorboard=true"])
    msg = str(e.value)
    assert "observability.tensorboard is a key of every job spec" in msg, msg
    assert "default False" in msg and "does not set it" in msg and "has it" not in msg, msg
    # environment variables are added without '+'
    assert load_spec(str(p), ["env.MY_FLAG=1"]).env.MY_FLAG == "1"


def test_unknown_spec_keys_suggest_the_nearest():
    with pytest.raises(SpecError, match=r"checkpoint.every_step.*did you mean 'every_steps'"):
        load_spec(base(checkpoint={"every_step": 5}))
    with pytest.raises(SpecError, match=r"failovr.*did you mean 'failover'"):
        load_spec(base(failovr={"max_restarts": 1}))


def test_wrong_type():
    with pytest.raises(SpecError) as e:
        load_spec(base(), ["roles.trainer.total=two"])
    msg = str(e.value)
    assert "roles.trainer.total" in msg and "'two'" in msg and "int" in msg


def test_total_not_divisible_by_per_node():
    with pytest.raises(SpecError) as e:
        load_spec(base(), ["roles.trainer.total=3"])
    msg = str(e.value)
    assert "roles.trainer.per_node: 2 is invalid" in msg
    assert "total 3 is not divisible by per_node 2" in msg
    assert "a divisor of total=3 (1, 3)" in msg


def test_collocation_names_missing_role():
    with pytest.raises(SpecError, match=r"collocation\[0\]\[1\]: 'rollout' is invalid; allowed: "
                                        r"a role of this job: trainer"):
        load_spec(base(collocation=[["trainer", "rollout"]]))


def test_cycle_in_edges():
    spec = {"name": "c", "driver": "x.y:Driver",
            "roles": {r: {"workload": W} for r in ("a", "b", "c")},
            "edges": [["a", "b"], ["b", "c"], ["c", "a"]]}
    with pytest.raises(SpecError) as e:
        load_spec(spec)
    msg = str(e.value)
    assert msg.startswith("edges: ") and "cycle" in msg and "a DAG" in msg


def test_edge_names_missing_role():
    spec = {"name": "c", "driver": "x.y:Driver", "roles": {"a": {"workload": W}},
            "edges": [["a", "zz"]]}
    with pytest.raises(SpecError, match=r"edges\[0\]\[1\]: 'zz'.*a role of this job: a"):
        load_spec(spec)


def test_unknown_template_backend_saver_placement():
    with pytest.raises(SpecError, match=r"template: 'nope'.*unknown graph template 'nope'; "
                                        r"installed: .*sft"):
        load_spec(base(template="nope"))
    with pytest.raises(SpecError, match=r"roles.trainer.backend: 'colossalai'.*unknown backend "
                                        r"'colossalai'; installed: ddp, (.*, )?fsdp"):
        load_spec(base(), ["roles.trainer.backend=colossalai"])
    with pytest.raises(SpecError, match=r"checkpoint.saver: 'tape'.*installed: .*disk"):
        load_spec(base(), ["checkpoint.saver=tape"])
    with pytest.raises(SpecError, match=r"placement: 'random'.*installed: pack, spread"):
        load_spec(base(), ["placement=random"])


def test_workload_path_and_missing_name():
    with pytest.raises(SpecError, match=r"roles.trainer.workload: 'examples.nanogpt' is invalid;"
                                        r" allowed: an import path 'package.module:Class'"):
        load_spec(base(), ["roles.trainer.workload=examples.nanogpt"])
    spec = base()
    del spec["name"]
    with pytest.raises(SpecError, match="name: None is invalid"):
        load_spec(spec)


def test_template_requires_its_roles():
    spec = {"name": "x", "template": "sft", "roles": {"worker": {"workload": W}}}
    with pytest.raises(SpecError, match=r"template 'sft' requires role 'trainer'"):
        load_spec(spec)


def test_bad_numbers():
    with pytest.raises(SpecError, match=r"roles.trainer.total: 0 is invalid; allowed: an integer"
                                        r" >= 1"):
        load_spec(base(), ["roles.trainer.total=0", "roles.trainer.per_node=0"])
    with pytest.raises(SpecError, match=r"checkpoint.keep: 0"):
        load_spec(base(), ["checkpoint.keep=0"])
    with pytest.raises(SpecError, match=r"override>: 'novalue' .*key=value"):
        load_spec(base(), ["novalue"])


def test_builder_full_chain():
    job = (DLJobBuilder().name("b").dl_type("SFT").node_num(1).device_per_node(2)
           .config({"max_steps": 3}).global_env({"A": "1"})
           .workload("trainer", "examples.nanogpt.workload", "GPTWorkload")
           .total(2).per_node(2).env({"B": "2"}).backend("fsdp")
           .workload("eval", "examples.nanogpt.workload", "GPTWorkload").total(1)
           .with_collocation("trainer", "eval")
           .build())
    s = job.spec
    assert s.template == "sft"
    assert s.roles.trainer.total == 2 and s.roles.trainer.env.B == "2"
    assert s.env.A == "1" and s.config.max_steps == 3
    assert [list(e) for e in s.edges] == [["trainer", "eval"]]
    assert [list(g) for g in s.collocation] == [["trainer", "eval"]]


def test_builder_collocation_all_and_errors():
    b = (DLJobBuilder().name("b").trainer("m", "Driver")
         .workload("actor", "m", "A").total(2).per_node(2)
         .workload("rollout", "m", "R").total(2).per_node(2)
         .with_collocation_all())
    assert b.to_dict()["collocation"] == [["actor", "rollout"]]
    with pytest.raises(SpecError, match="dl_type: 'XL'"):
        DLJobBuilder().dl_type("XL")
    with pytest.raises(SpecError, match=r"node_num: 0 is invalid; allowed: an integer >= 1"):
        DLJobBuilder().node_num(0)
    bad = DLJobBuilder().name("b").workload("trainer", "m", "T").total(3).per_node(2)
    with pytest.raises(SpecError, match="not divisible"):
        bad.build()


def test_collocated_roles_must_share_per_node():
    spec = {"name": "c", "driver": "x.y:Driver",
            "roles": {"a": {"workload": W, "total": 2, "per_node": 2},
                      "b": {"workload": W, "total": 2, "per_node": 1}},
            "collocation": [["a", "b"]]}
    with pytest.raises(SpecError, match=r"collocation\[0\].*per_node differs: a=2, b=1.*same per_node"):
        load_spec(spec)
