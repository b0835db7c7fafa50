"""Plugin discovery through real entry points of fake installed distributions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dlrover_core.plugins.manager import PluginError, PluginManager, UnknownPluginError
from dlrover_core.testing import make_fake_dist

GOOD = """
from dlrover_core import Backend, hookimpl

@hookimpl
def dlrover_backends():
    return [Backend(name="goodbe", session="goodmod:Session", description="a test backend")]
"""

BROKEN = """
raise ImportError("no module named 'megatron' (fake)")
"""

BLOCKED = """
from dlrover_core import CheckpointSaver, hookimpl

@hookimpl
def dlrover_checkpoint_savers():
    return [CheckpointSaver(name="blockedsaver", saver="x:Y")]
"""


def install_three(fake_dist):
    fake_dist("dlrover-plugin-good", "good", GOOD, "1.2.3")
    fake_dist("dlrover-plugin-broken", "broken", BROKEN)
    fake_dist("dlrover-plugin-blocked", "blocked", BLOCKED)


def test_good_broken_blocked(fake_dist):
    install_three(fake_dist)
    pm = PluginManager(env={"DLROVER_DISABLE_PLUGINS": "blocked"})
    infos = {i.name: i for i in pm.plugins()}
    assert infos["good"].status == "active"
    assert infos["good"].version == "1.2.3"
    assert infos["good"].distribution == "dlrover-plugin-good"
    assert infos["good"].provides == ["backend:goodbe"]
    assert "dlrover_backends" in infos["good"].hooks
    assert infos["broken"].status == "failed"
    assert "no module named 'megatron' (fake)" in infos["broken"].error
    assert infos["blocked"].status == "blocked"
    assert "DLROVER_DISABLE_PLUGINS" in infos["blocked"].error
    # nothing else broke: the builtin plugin and the good one work
    assert pm.get_backend("goodbe").provider == "good"
    assert set(pm.placement_policies()) >= {"pack", "spread"}
    assert "disk" in pm.savers()


def test_blocked_plugin_is_never_imported(fake_dist):
    fake_dist("dlrover-plugin-boom", "boom", "raise SystemExit('imported!')")
    pm = PluginManager(env={"DLROVER_DISABLE_PLUGINS": "boom, other"})
    assert {i.name: i.status for i in pm.plugins()}["boom"] == "blocked"


def test_unknown_name_lists_installed_and_broken(fake_dist):
    install_three(fake_dist)
    pm = PluginManager(env={"DLROVER_DISABLE_PLUGINS": "blocked"})
    with pytest.raises(UnknownPluginError) as e:
        pm.get_backend("colossalai")
    msg = str(e.value)
    assert "unknown backend 'colossalai'" in msg
    assert "installed: " in msg and "goodbe" in msg
    assert "broken (failed" in msg
    with pytest.raises(UnknownPluginError, match=r"unknown checkpoint saver 'blockedsaver'; "
                                                 r"installed: disk"):
        pm.get_saver("blockedsaver")


def test_selecting_a_failed_plugins_name_says_why(fake_dist):
    fake_dist("dlrover-plugin-megatron", "megatron", BROKEN)
    pm = PluginManager()
    with pytest.raises(UnknownPluginError, match="plugin 'megatron' would provide it but is "
                                                 "failed: ImportError"):
        pm.get_backend("megatron")


def test_name_clash_names_both_providers(fake_dist):
    fake_dist("dlrover-plugin-a", "alpha", GOOD)
    fake_dist("dlrover-plugin-b", "beta", GOOD)
    pm = PluginManager()
    with pytest.raises(PluginError, match="backend 'goodbe' is provided by both plugin "
                                          "'alpha' and plugin 'beta'"):
        pm.backends()


def test_bad_record_name_is_rejected():
    from dlrover_core import Backend

    with pytest.raises(ValueError, match="name 'Bad Name' is invalid"):
        Backend(name="Bad Name")


def test_classifier_order_plugin_first(fake_dist):
    fake_dist("dlrover-plugin-nccl", "nccl", """
from dlrover_core import FailureVerdict, hookimpl

@hookimpl
def dlrover_classify_failure(failure, history):
    if "NCCL watchdog" in failure.message:
        return FailureVerdict("node", "NCCL watchdog: bad NIC")
    return None
""")
    from dlrover_core import Failure

    pm = PluginManager()
    v = pm.classify_failure(Failure("user_error", "trainer", 0, message="NCCL watchdog timeout"))
    assert (v.level, v.classifier) == ("node", "nccl")
    v = pm.classify_failure(Failure("actor_died", "trainer", 0, message="SIGKILL"))
    assert (v.level, v.classifier) == ("process", "builtin")


def test_cli_plugins_list_json(tmp_path):
    root = make_fake_dist(tmp_path, "dlrover-plugin-good", "good", GOOD, "1.2.3")
    make_fake_dist(tmp_path, "dlrover-plugin-broken", "broken", BROKEN)
    make_fake_dist(tmp_path, "dlrover-plugin-blocked", "blocked", BLOCKED)
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DLROVER_DISABLE_PLUGINS": "blocked"}
    out = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "plugins", "list",
                          "--json"], env=env, capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    assert [r["name"] for r in rows] == sorted(r["name"] for r in rows)
    for r in rows:
        assert set(r) == {"name", "version", "distribution", "hooks", "provides", "status",
                          "error"}
    by = {r["name"]: r for r in rows}
    assert by["good"]["status"] == "active" and by["good"]["provides"] == ["backend:goodbe"]
    assert by["broken"]["status"] == "failed" and "ImportError" in by["broken"]["error"]
    assert by["blocked"]["status"] == "blocked"
    assert by["builtin"]["distribution"] == "dlrover-core"
    # the table form works too, and lists the failed plugin's error
    table = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "plugins", "list"],
                           env={**env, "COLUMNS": "200"}, capture_output=True, text=True,
                           check=True).stdout
    assert "failed" in table and "megatron" in table
