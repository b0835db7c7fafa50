"""The ppo and grpo templates: roles, edges, driver, validation of roles and config.rl."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from dlrover_core import SpecError, load_spec
from dlrover_core.cli.main import main as dlrover_main
from dlrover_core.plugins.manager import PluginManager
from dlrover_plugin_ppo.builder import RLJobBuilder

TOY = "dlrover_plugin_ppo.toy"


def roles(*names, **totals):
    return {n: {"workload": f"{TOY}:Toy{n.capitalize()}", "total": totals.get(n, 1),
                "resources": {"cpu": 0.25}} for n in names}


def test_templates_are_registered_with_their_roles():
    pm = PluginManager()
    ppo, grpo = pm.get_template("ppo"), pm.get_template("grpo")
    assert ppo.provider == grpo.provider == "ppo"
    assert {r.name: r.required for r in ppo.roles} == {
        "actor": True, "critic": True, "rollout": False, "reference": False, "reward": False}
    assert {r.name: r.required for r in grpo.roles} == {
        "actor": True, "rollout": False, "reference": False, "reward": False}
    assert ppo.driver == grpo.driver == "dlrover_plugin_ppo.trainer:PPOTrainer"
    assert ("rollout", "critic") in ppo.edges and ("critic", "actor") in ppo.edges
    assert all("critic" not in e for e in grpo.edges)


def test_cli_lists_templates_with_roles():
    out = io.StringIO()
    with redirect_stdout(out):
        assert dlrover_main(["templates", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(out.getvalue())}
    assert [r["name"] for r in rows["grpo"]["roles"]] == ["actor", "rollout", "reference",
                                                          "reward"]
    assert rows["ppo"]["roles"][0] == {"name": "actor", "required": True, "pattern": False,
                                       "description": rows["ppo"]["roles"][0]["description"]}


def test_spec_gets_edges_driver_and_rl_defaults():
    spec = load_spec({"name": "p", "template": "ppo",
                      "roles": roles("actor", "critic", "rollout", "reward", rollout=2)})
    assert spec.driver == "dlrover_plugin_ppo.trainer:PPOTrainer"
    assert sorted(map(tuple, spec.edges)) == sorted([
        ("rollout", "reward"), ("rollout", "actor"), ("reward", "actor"),
        ("rollout", "critic"), ("critic", "actor")])
    assert spec.config.rl.gamma == 0.99 and spec.config.rl.kl_mode == "reward"
    assert spec.config.rl_algorithm == "ppo"
    g = load_spec({"name": "g", "template": "grpo", "roles": roles("actor", "rollout"),
                   "config": {"rl": {"kl_coef": 0.04}}})
    assert g.config.rl.kl_mode == "loss" and g.config.rl.samples_per_prompt == 8
    assert g.config.rl.kl_coef == 0.04


def test_missing_actor_is_an_error():
    with pytest.raises(SpecError, match=r"roles.actor.*template 'ppo' requires role 'actor'"):
        load_spec({"name": "p", "template": "ppo", "roles": roles("critic", "rollout")})
    with pytest.raises(SpecError, match=r"template 'grpo' requires role 'actor'"):
        load_spec({"name": "g", "template": "grpo", "roles": roles("rollout")})


def test_grpo_rejects_a_critic_and_ppo_needs_one():
    with pytest.raises(SpecError, match=r"roles.critic: 'critic' is invalid; allowed: roles of "
                                        r"template 'grpo': actor, rollout, reference, reward"):
        load_spec({"name": "g", "template": "grpo", "roles": roles("actor", "critic")})
    with pytest.raises(SpecError, match=r"requires role 'critic'"):
        load_spec({"name": "p", "template": "ppo", "roles": roles("actor", "rollout")})


def test_uneven_handoff_is_rejected_with_the_numbers():
    with pytest.raises(SpecError, match=r"roles.rollout.total: 3 is invalid .*; allowed: a "
                                        r"multiple of roles.reward.total=2"):
        load_spec({"name": "p", "template": "grpo",
                   "roles": roles("actor", "rollout", "reward", rollout=3, reward=2)})


@pytest.mark.parametrize("key,value,allowed", [
    ("clip_ratio", -0.1, "a number in (0, 1)"),
    ("kl_mode", "both", "reward, loss"),
    ("epochs", 1.5, "an integer"),
    ("minibatch_unit", "token", "row, step"),
    ("gama", 0.9, "one of: iterations"),
])
def test_bad_rl_settings_name_key_value_and_allowed(key, value, allowed):
    with pytest.raises(SpecError) as err:
        load_spec({"name": "p", "template": "ppo", "roles": roles("actor", "critic"),
                   "config": {"rl": {key: value}}})
    msg = str(err.value)
    assert f"config.rl.{key}: {value!r} is invalid" in msg and allowed in msg


def test_grpo_needs_groups_and_enough_prompts():
    with pytest.raises(SpecError, match=r"config.rl.samples_per_prompt: 1 .*>= 2 for grpo"):
        load_spec({"name": "g", "template": "grpo", "roles": roles("actor"),
                   "config": {"rl": {"samples_per_prompt": 1}}})
    with pytest.raises(SpecError, match=r"prompts_per_iter: 2 .*at least roles.rollout.total=4"):
        load_spec({"name": "g", "template": "grpo", "roles": roles("actor", "rollout", rollout=4),
                   "config": {"rl": {"prompts_per_iter": 2}}})


def test_rl_job_builder_and_dl_type_rl():
    job = (RLJobBuilder().name("b").rl(iterations=3)
           .actor(TOY, "ToyActor").resource(cpu=0.25)
           .critic(TOY, "ToyCritic").resource(cpu=0.25)
           .rollout(TOY, "ToyRollout").total(2).resource(cpu=0.25)
           .with_collocation("actor", "rollout")
           .build())
    assert job.spec.template == "ppo" and job.spec.config.rl.iterations == 3
    assert list(job.spec.collocation[0]) == ["actor", "rollout"]
    from dlrover_core import DLJobBuilder

    plain = (DLJobBuilder().name("d").dl_type("RL")
             .workload("actor", TOY, "ToyActor").resource(cpu=0.25)
             .workload("critic", TOY, "ToyCritic").resource(cpu=0.25).build())
    assert plain.spec.template == "ppo"
    assert plain.spec.driver == "dlrover_plugin_ppo.trainer:PPOTrainer"
    with pytest.raises(SpecError, match="template: 'a2c' is invalid; allowed: ppo, grpo"):
        RLJobBuilder("a2c")


def test_a_zero_total_is_reported_by_the_core_not_a_crash():
    with pytest.raises(SpecError, match=r"roles.reward.total: 0 is invalid; allowed: an integer >= 1"):
        load_spec({"name": "g", "template": "grpo",
                   "roles": roles("actor", "rollout", "reward", reward=0)})
