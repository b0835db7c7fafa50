"""The fsdp plugin: registration, real 2-rank gloo groups under DDP and FSDP2, and
bit-exact sharded checkpoints through the dcp engine and the disk saver."""

from __future__ import annotations

import pytest
import torch

from dlrover_core.testing import (
    call_all,
    heavy_modules_after,
    kill_actors,
    plugin_row,
    spawn_role,
)

W = "plugins.fsdp.tests.fsdp_workloads:Sharded"


def test_active_in_plugins_list():
    row = plugin_row("fsdp")
    assert row["status"] == "active", row["error"]
    assert row["distribution"] == "dlrover-plugin-fsdp"
    assert row["provides"] == ["backend:ddp", "backend:fsdp", "engine:dcp"]


def test_plugin_module_imports_no_torch():
    code = "import dlrover_plugin_fsdp.plugin as p; p.dlrover_backends()"
    assert heavy_modules_after(code, ["torch"]) == []


@pytest.fixture
def roles(ray_cluster, tmp_path):
    made = []

    def start(backend):
        hs = spawn_role("trainer", W, 2, backend=backend, job=f"fsdp-{backend}")
        made.extend(hs)
        return hs

    yield start
    kill_actors(made)


def test_fsdp2_matches_ddp(roles):
    ddp, fsdp = roles("ddp"), roles("fsdp")
    l_ddp = call_all(ddp, "train", 4)[0]
    l_fsdp = call_all(fsdp, "train", 4)[0]
    assert l_ddp == pytest.approx(l_fsdp, rel=1e-5)
    assert l_fsdp[-1] < l_fsdp[0]
    total = sum(p.numel() for p in torch.nn.Linear(16, 32).parameters()) + \
        sum(p.numel() for p in torch.nn.Linear(32, 4).parameters())
    assert sum(call_all(fsdp, "local_numel")) == total  # FSDP2 shards: each rank holds a part
    assert call_all(ddp, "local_numel") == [total, total]


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_sharded_checkpoint_round_trip_bit_exact(roles, backend, tmp_path):
    hs = roles(backend)
    call_all(hs, "use_checkpoint_dir", str(tmp_path))
    call_all(hs, "train", 3)
    before = call_all(hs, "full_state")[0]
    call_all(hs, "save", 3)
    call_all(hs, "scramble")
    assert not torch.equal(call_all(hs, "full_state")[0]["p.a.weight"], before["p.a.weight"])
    assert call_all(hs, "load") == [3, 3]
    after = call_all(hs, "full_state")[0]
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k

