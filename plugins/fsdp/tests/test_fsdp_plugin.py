"""The fsdp plugin: registration, real 2-rank gloo groups under DDP and FSDP2, and
bit-exact sharded checkpoints through the dcp engine and the disk saver."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import ray
import torch

from dlrover_core.testing import spawn_role

W = "plugins.fsdp.tests.fsdp_workloads:Sharded"


def test_active_in_plugins_list():
    out = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "plugins", "list",
                          "--json"], capture_output=True, text=True, check=True).stdout
    row = {r["name"]: r for r in json.loads(out)}["fsdp"]
    assert row["status"] == "active", row["error"]
    assert row["distribution"] == "dlrover-plugin-fsdp"
    assert row["provides"] == ["backend:ddp", "backend:fsdp", "engine:dcp"]


def test_plugin_module_imports_no_torch():
    code = ("import sys, dlrover_plugin_fsdp.plugin as p; p.dlrover_backends();"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


@pytest.fixture
def roles(ray_cluster, tmp_path):
    made = []

    def start(backend):
        hs = spawn_role("trainer", W, 2, backend=backend, job=f"fsdp-{backend}")
        made.extend(hs)
        return hs

    yield start
    for h in made:
        ray.kill(h)


def _call(hs, method, *args):
    return ray.get([h.call.remote(method, *args) for h in hs])


def test_fsdp2_matches_ddp(roles):
    ddp, fsdp = roles("ddp"), roles("fsdp")
    l_ddp = _call(ddp, "train", 4)[0]
    l_fsdp = _call(fsdp, "train", 4)[0]
    assert l_ddp == pytest.approx(l_fsdp, rel=1e-5)
    assert l_fsdp[-1] < l_fsdp[0]
    total = sum(p.numel() for p in torch.nn.Linear(16, 32).parameters()) + \
        sum(p.numel() for p in torch.nn.Linear(32, 4).parameters())
    assert sum(_call(fsdp, "local_numel")) == total  # FSDP2 shards: each rank holds a part
    assert _call(ddp, "local_numel") == [total, total]


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_sharded_checkpoint_round_trip_bit_exact(roles, backend, tmp_path):
    hs = roles(backend)
    _call(hs, "use_checkpoint_dir", str(tmp_path))
    _call(hs, "train", 3)
    before = _call(hs, "full_state")[0]
    _call(hs, "save", 3)
    _call(hs, "scramble")
    assert not torch.equal(_call(hs, "full_state")[0]["p.a.weight"], before["p.a.weight"])
    assert _call(hs, "load") == [3, 3]
    after = _call(hs, "full_state")[0]
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k

