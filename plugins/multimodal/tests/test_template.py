"""The multimodal template: roles, edges, driver, and the spec errors it reports before
anything starts."""

from __future__ import annotations

import copy

import pytest

from dlrover_core import DLJobBuilder, SpecError, load_spec
from dlrover_core.plugins.manager import PluginManager

TOY = "dlrover_plugin_multimodal.toy"


def spec(**changes):
    s = {
        "name": "mm", "template": "multimodal",
        "roles": {
            "trainer": {"workload": f"{TOY}:ToyTrainer", "resources": {"cpu": 0.25}},
            "vision_encoder": {"workload": f"{TOY}:ToyVecEncoder", "resources": {"cpu": 0.25}},
            "text_encoder": {"workload": f"{TOY}:ToyTextEncoder", "resources": {"cpu": 0.25}},
        },
        "collocation": [["trainer", "vision_encoder"]],
        "config": {"multimodal": {
            "data": {"dataset": f"{TOY}:ToyPairs", "modalities": ["vec", "tag"]},
            "encoders": {"vision_encoder": {"modality": "vec", "trainable": True},
                         "text_encoder": {"modality": "tag"}},
            "batch_size": 16}},
    }
    s = copy.deepcopy(s)
    for path, value in changes.items():
        node = s
        keys = path.split("__")
        for k in keys[:-1]:
            node = node[k]
        if value is None:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return s


def extra_encoder(role: str, modality: str) -> dict:
    """The :func:`spec` changes that add an encoder role ``role`` (a toy text encoder)
    for ``modality``."""
    return {f"roles__{role}": {"workload": f"{TOY}:ToyTextEncoder"},
            f"config__multimodal__encoders__{role}": {"modality": modality}}


def test_template_is_registered():
    t = PluginManager().get_template("multimodal")
    assert t.provider == "multimodal"
    assert t.driver == "dlrover_plugin_multimodal.driver:MultimodalDriver"


def test_spec_gets_edges_driver_defaults_and_encoder_workloads():
    s = load_spec(spec())
    assert s.driver == "dlrover_plugin_multimodal.driver:MultimodalDriver"
    assert sorted(map(tuple, s.edges)) == [("text_encoder", "trainer"),
                                           ("vision_encoder", "trainer")]
    mm = s.config.multimodal
    assert mm.encoders.vision_encoder.workload == f"{TOY}:ToyVecEncoder"
    assert mm.encoders.vision_encoder.cache is False  # trainable: no cache
    assert mm.encoders.text_encoder.cache is True and mm.encoders.text_encoder.trainable is False
    assert mm.epochs == 1 and mm.prefetch == 1 and mm.evaluate is True


def test_dl_type_multimodal_selects_the_template():
    s = spec()
    b = DLJobBuilder().name("b").dl_type("MULTIMODAL").config(s["config"])
    for role, r in s["roles"].items():
        b.workload(role, *r["workload"].split(":")).resource(cpu=0.25)
    job = b.with_collocation("trainer", "vision_encoder").build()
    assert job.spec.template == "multimodal"
    assert job.spec.driver.endswith(":MultimodalDriver")


def test_every_modality_of_the_data_needs_an_encoder_role():
    with pytest.raises(SpecError) as err:
        load_spec(spec(config__multimodal__data__modalities=["vec", "tag", "audio"]))
    msg = str(err.value)
    assert "config.multimodal.data.modalities[2]: 'audio' is invalid" in msg
    assert "encoders: tag (text_encoder), vec (vision_encoder)" in msg


def test_missing_trainer_and_unknown_roles():
    with pytest.raises(SpecError, match=r"roles.trainer: None .*template 'multimodal' requires "
                                        r"role 'trainer'"):
        load_spec(spec(roles__trainer=None, collocation=[]))
    with pytest.raises(SpecError, match=r"roles.audio_encoder: 'audio_encoder' is invalid .*"
                                        r"add config.multimodal.encoders.audio_encoder"):
        load_spec(spec(roles__audio_encoder={"workload": f"{TOY}:ToyTextEncoder"}))
    with pytest.raises(SpecError, match=r"config.multimodal.encoders.text_encoder: "
                                        r"'text_encoder' is invalid .*a role of this job"):
        load_spec(spec(roles__text_encoder=None))


def test_a_trainable_encoder_must_share_the_trainers_bundles():
    with pytest.raises(SpecError) as err:
        load_spec(spec(collocation=[]))
    msg = str(err.value)
    assert msg.startswith("collocation: [] is invalid")
    assert "allowed: a collocation group with trainer and vision_encoder" in msg


@pytest.mark.parametrize("change,match", [
    ({"config__multimodal__encoders__vision_encoder": {"modality": "vec", "trainable": True,
                                                       "cache": True}},
     r"encoders.vision_encoder.cache: True is invalid .*only frozen encoders cache"),
    ({"config__multimodal__batch_size": 0}, r"batch_size: 0 is invalid; allowed: an integer >= 1"),
    ({"config__multimodal__epochs": 1.5}, r"epochs: 1.5 is invalid; allowed: an integer"),
    ({"config__multimodal__shuffle": True},
     (r"config.multimodal.shuffle: True is invalid \(unknown multimodal setting\); "
      r"allowed: one of: data, encoders, batch_size")),
    ({"config__multimodal__data__dataset": "nodots"},
     r"data.dataset: 'nodots' is invalid; allowed: an import path"),
    ({"config__multimodal__encoders__text_encoder": {"modality": "tag", "frozen": True}},
     r"encoders.text_encoder.frozen: True is invalid \(unknown encoder setting\)"),
    ({"config__multimodal": None}, r"config.multimodal: None is invalid \(missing\)"),
    # an encoder of a modality the data lacks; two encoders of one modality
    (extra_encoder("audio_encoder", "words"),
     r"encoders.audio_encoder.modality: 'words' is invalid.*"
     r"allowed: a modality of the data: vec, tag"),
    (extra_encoder("text_encoder_2", "tag"),
     r"encoders: \['text_encoder', 'text_encoder_2'\] is invalid .*; "
     r"allowed: one encoder role per modality"),
])
def test_bad_settings_name_key_value_and_allowed(change, match):
    with pytest.raises(SpecError, match=match):
        load_spec(spec(**change))


def test_batch_must_split_over_trainer_and_encoder_ranks():
    with pytest.raises(SpecError, match=r"batch_size: 16 is invalid .*allowed: a multiple of "
                                        r"roles.trainer.total=3"):
        load_spec(spec(roles__trainer__total=3, roles__trainer__backend="ddp",
                       roles__vision_encoder__total=3))
    with pytest.raises(SpecError, match=r"roles.text_encoder.total: 20 is invalid .*at most "
                                        r"config.multimodal.batch_size=16"):
        load_spec(spec(roles__text_encoder__total=20))


def test_encoders_are_replaced_and_the_trainer_rolls_back_unless_the_spec_says_otherwise():
    """``roles.<role>.config.failover``: the graph's scope of a failure (seed 000)."""
    from dlrover_core.graph.graph import ComputationGraph

    g = ComputationGraph.from_spec(load_spec(spec()))
    assert {r: g.failover_policy(r) for r in g.order} == {
        "trainer": "rollback", "vision_encoder": "replace", "text_encoder": "replace"}
    s = load_spec(spec(roles__text_encoder__config={"failover": "rollback"}))
    assert ComputationGraph.from_spec(s).failover_policy("text_encoder") == "rollback"
    with pytest.raises(SpecError, match=r"roles.vision_encoder.config.failover: 'retry' is "
                                        r"invalid .*; allowed: replace, rollback"):
        load_spec(spec(roles__vision_encoder__config={"failover": "retry"}))
