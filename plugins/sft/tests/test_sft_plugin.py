"""The sft plugin: registration and the template's validation."""

from __future__ import annotations

import pytest

from dlrover_core import DLJobBuilder, SpecError, load_spec
from dlrover_core.testing import dlrover_json, plugin_row

W = "examples.nanogpt.workload:GPTWorkload"


def test_active_in_plugins_list():
    row = plugin_row("sft")
    assert row["status"] == "active", row["error"]
    assert row["provides"] == ["template:sft"]
    assert row["distribution"] == "dlrover-plugin-sft"


def test_templates_list_shows_roles():
    sft = {t["name"]: t for t in dlrover_json("templates", "list")}["sft"]
    assert [(r["name"], r["required"]) for r in sft["roles"]] == [("trainer", True),
                                                                   ("eval", False)]
    assert sft["driver"] is None


def test_defaults_and_edges():
    spec = load_spec({"name": "s", "template": "sft",
                      "roles": {"trainer": {"workload": W, "total": 2},
                                "eval": {"workload": W}}})
    assert spec.roles.trainer.backend == "ddp"  # template default
    assert [list(e) for e in spec.edges] == [["trainer", "eval"]]
    assert spec.driver is None


def test_missing_trainer_and_unknown_role():
    with pytest.raises(SpecError, match="template 'sft' requires role 'trainer'"):
        load_spec({"name": "s", "template": "sft", "roles": {"eval": {"workload": W}}})
    with pytest.raises(SpecError, match=r"roles.critic: 'critic' is invalid; allowed: roles of "
                                        r"template 'sft': trainer, eval"):
        load_spec({"name": "s", "template": "sft",
                   "roles": {"trainer": {"workload": W}, "critic": {"workload": W}}})


def test_no_driver_allowed():
    with pytest.raises(SpecError, match=r"driver: 'x.y:Z' is invalid.*no driver for template"):
        load_spec({"name": "s", "template": "sft", "driver": "x.y:Z",
                   "roles": {"trainer": {"workload": W}}})


def test_builder_dl_type_sft_selects_template():
    job = (DLJobBuilder().name("b").dl_type("SFT").workload("trainer", "examples.nanogpt.workload",
                                                            "GPTWorkload").total(2).build())
    assert job.spec.template == "sft"
