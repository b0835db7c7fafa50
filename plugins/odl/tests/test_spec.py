"""The odl template and its spec errors, the replay source and published versions
(no Ray: everything here runs in the test process)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from dlrover_plugin_odl.publish import load_latest, publish, version_dir, versions
from dlrover_plugin_odl.source import ReplaySource

from dlrover_core import SpecError, load_spec
from dlrover_core.testing import crash_renames_after

TOY = "dlrover_plugin_odl.toy"
REPLAY = {"kind": "replay", "options": {"records": f"{TOY}:toy_records", "kwargs": {"n": 10}}}


def job(**over):
    spec = copy.deepcopy({"name": "odl-spec", "template": "odl",
            "roles": {"trainer": {"workload": f"{TOY}:ToyTrainer"}},
            "checkpoint": {"every_steps": 5},
            "config": {"odl": {"source": REPLAY}}})
    for key, value in over.items():
        node = spec
        *path, last = key.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return spec


def test_template_fills_source_preprocess_driver_and_defaults(plugin_manager):
    spec = load_spec(job(roles__eval={"workload": f"{TOY}:ToyEval"}))
    assert spec.roles.source.workload == "dlrover_plugin_odl.workloads:SourceWorkload"
    assert spec.roles.preprocess.workload == "dlrover_plugin_odl.workloads:PreprocessWorkload"
    assert spec.roles.source.resources.cpu == 0.5
    assert spec.driver == "dlrover_plugin_odl.driver:ODLTrainer"
    assert sorted(map(tuple, spec.edges)) == [("preprocess", "eval"), ("preprocess", "trainer"),
                                              ("source", "preprocess")]
    assert spec.config.odl.batch_size == 64 and spec.config.odl.buffer == 4
    assert spec.config.odl.source.kind == "replay"
    # the stateless preprocess is replaced under the driver; the others restart it
    assert {r: spec.roles[r].config.failover for r in spec.roles} == {
        "source": "rollback", "preprocess": "replace", "trainer": "rollback",
        "eval": "rollback"}
    given = load_spec(job(roles__preprocess={
        "workload": "dlrover_plugin_odl.workloads:PreprocessWorkload",
        "config": {"failover": "rollback"}}))
    assert given.roles.preprocess.config.failover == "rollback"


def test_each_role_scales_on_its_own(plugin_manager):
    spec = load_spec(job(roles__source={"total": 3}, roles__preprocess={
        "workload": "dlrover_plugin_odl.workloads:PreprocessWorkload", "total": 2}))
    assert (spec.roles.source.total, spec.roles.preprocess.total, spec.roles.trainer.total) == \
        (3, 2, 1)
    assert spec.roles.source.workload.endswith(":SourceWorkload")  # filled in


@pytest.mark.parametrize("over, key, words", [
    ({"config__odl__source__kind": "kafka"}, "config.odl.source.kind",
     "unknown stream source 'kafka'; installed: "),
    ({"config__odl__source__options": {"kwargs": {}}}, "config.odl.source.options.records",
     "import path"),
    ({"config__odl__source": {"kind": "replay", "options": {"records": "m:f", "speed": 2}}},
     "config.odl.source.options.speed", "options of the replay source"),
    ({"config__odl__source": {"kind": "redis", "options": {"port": 6379}}},
     "config.odl.source.options.stream", "the name of a Redis stream"),
    ({"config__odl__source": {"kind": "redis", "options": {"stream": "s", "port": 70000}}},
     "config.odl.source.options.port", "a TCP port"),
    ({"config__odl__batch_size": 0}, "config.odl.batch_size", "an integer >= 1"),
    ({"config__odl__chunk_batches": 0}, "config.odl.chunk_batches", "an integer >= 1"),
    ({"config__odl__buffer": "big"}, "config.odl.buffer", "an integer"),
    ({"config__odl__bufer": 3}, "config.odl.bufer", "one of batch_size, buffer"),
    ({"config__odl__checkpoint_every_s": -1}, "config.odl.checkpoint_every_s", "seconds >= 0"),
    ({"config__odl__publish_every_s": "often"}, "config.odl.publish_every_s",
     "seconds >= 0 (0: off)"),
    ({"checkpoint__every_steps": 0}, "checkpoint.every_steps",
     "committed with the trainer's checkpoint"),
    ({"roles__trainer__total": 2, "roles__trainer__backend": "ddp", "config__odl__buffer": 1},
     "config.odl.buffer", "at least roles.trainer.total=2"),
    ({"roles__trainer__total": 2}, "roles.trainer.backend", "a backend such as ddp"),
    ({"roles__source__config": {"failover": "replace"}}, "roles.source.config.failover",
     "rollback (replace only for preprocess)"),
    ({"roles__trainer__config": {"failover": "again"}}, "roles.trainer.config.failover",
     "replace, rollback"),
])
def test_spec_errors_name_key_value_and_what_is_allowed(plugin_manager, over, key, words):
    with pytest.raises(SpecError) as err:
        load_spec(job(**over))
    assert err.value.key == key
    assert words in str(err.value)


def test_trainer_is_required_and_unknown_roles_refused(plugin_manager):
    with pytest.raises(SpecError, match="requires role 'trainer'"):
        load_spec({"name": "x", "template": "odl", "roles": {}, "config": {"odl": {
            "source": REPLAY}}, "checkpoint": {"every_steps": 1}})
    with pytest.raises(SpecError, match="roles.critic"):
        load_spec(job(roles__critic={"workload": f"{TOY}:ToyTrainer"}))


def test_dlrover_plugins_list_shows_odl_active():
    out = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "plugins", "list",
                          "--json"], capture_output=True, text=True, check=True).stdout
    odl = next(p for p in json.loads(out) if p["name"] == "odl")
    assert odl["status"] == "active"
    assert {"template:odl", "stream_source:replay", "stream_source:redis"} <= set(odl["provides"])
    assert "dlrover_stream_sources" in odl["hooks"]


# ---------------------------------------------------------------------------- replay source
def test_replay_partitions_keep_stream_order_and_seek_resumes_after_a_position():
    opts = {"records": f"{TOY}:toy_records", "kwargs": {"n": 10}}
    parts = [ReplaySource(opts, p, 3) for p in range(3)]
    got = [src.read(100, 1.0) for src in parts]
    assert [r.positions for r in got] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert all(r.end for r in got)
    assert [rec["id"] for rec in got[0].records] == [0, 3, 6, 9]
    src = parts[0]
    src.seek(3)  # the trainer checkpointed position 3: replay resumes after it
    first = src.read(1, 1.0)
    assert first.positions == [6] and not first.end
    assert src.read(5, 1.0).positions == [9]


def test_replay_records_are_identical_on_every_replay():
    opts = {"records": f"{TOY}:toy_records", "kwargs": {"n": 50, "seed": 3}}
    a = ReplaySource(opts, 0, 1).read(50, 1.0).records
    b = ReplaySource(opts, 0, 1).read(50, 1.0).records
    assert a == b and len({json.dumps(r["x"]) for r in a}) == 50


# ---------------------------------------------------------------------------- published versions
def test_published_versions_are_atomic_verified_and_pruned(tmp_path):
    d = str(tmp_path / "published")
    model = torch.nn.Linear(3, 2)
    for v in (10, 20, 30, 40):
        with torch.no_grad():
            model.weight.fill_(float(v))
        publish(d, v, model.state_dict(), {"records": v * 8}, keep=3)
    assert versions(d) == [20, 30, 40]
    version, state, meta = load_latest(d)
    assert version == 40 and meta["records"] == 320 and float(state["weight"][0, 0]) == 40.0
    assert not [n for n in os.listdir(d) if n.startswith(".")]  # no temp dirs left
    # a corrupt newest version is skipped: the reader gets the previous one
    with open(os.path.join(version_dir(d, 40), "model.pt"), "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    version, state, _ = load_latest(d)
    assert version == 30 and float(state["weight"][0, 0]) == 30.0


@pytest.mark.parametrize("exchange", [True, False])
def test_republishing_a_version_never_leaves_it_missing(tmp_path, monkeypatch, exchange):
    """Version 10 is published again. A crash is injected at each rename of the
    publish (its files, the swap of the version directory or its two renames where
    the filesystem has no atomic exchange, ``latest``): afterwards version 10 is
    always there, whole old or new; before, the old directory was deleted first."""
    outcomes = set()
    for crash_at in range(8):
        d = str(tmp_path / f"c{crash_at}")
        publish(d, 10, {"w": torch.zeros(3)}, {"which": "old"})
        crash_renames_after(monkeypatch, crash_at, exchange)
        try:
            publish(d, 10, {"w": torch.ones(3)}, {"which": "new"})
            crashed = False
        except OSError:
            crashed = True
        monkeypatch.undo()
        assert versions(d) == [10], crash_at
        version, state, meta = load_latest(d)
        assert version == 10 and float(state["w"].sum()) == (3.0 if meta["which"] == "new"
                                                             else 0.0)
        outcomes.add((crashed, meta["which"]))
    assert outcomes == {(True, "old"), (True, "new"), (False, "new")}


def test_dl_type_odl_in_the_job_builder_selects_the_template(plugin_manager):
    from dlrover_core import DLJobBuilder

    job = (DLJobBuilder().name("odl-builder").dl_type("ODL")
           .config({"odl": {"source": REPLAY, "batch_size": 16}})
           .checkpoint(every_steps=10)
           .workload("trainer", TOY, "ToyTrainer").resource(cpu=0.5)
           .workload("eval", TOY, "ToyEval")
           .build())
    spec = job.spec
    assert spec.template == "odl" and spec.driver.endswith(":ODLTrainer")
    assert set(spec.roles) == {"source", "preprocess", "trainer", "eval"}
    assert spec.config.odl.batch_size == 16
