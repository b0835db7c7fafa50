"""The fsdp plugin: registration, real 2-rank gloo groups under DDP and FSDP2, and
bit-exact sharded checkpoints through the dcp engine and the disk saver."""

from __future__ import annotations

import pytest
import torch

from dlrover_core.testing import (
    call_all,
    end_rank_process,
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



def _warm_then_train(rank: int, store: str, warm: bool, out: str) -> None:
    """One rank: (``warm``) the standby's FSDP warm-up, then 3 real FSDP2 steps on a
    2-rank gloo group; writes its losses and what the warm-up left behind."""
    import json
    import sys

    import torch.distributed as dist

    from dlrover_core.runtime.context import WorkerContext
    from dlrover_plugin_fsdp.backend import FSDPSession

    torch.set_num_threads(1)
    seen = {"fsdp_imported_before": "torch.distributed.fsdp" in sys.modules}
    rng = torch.get_rng_state()
    if warm:
        FSDPSession(WorkerContext(job="j", role="trainer", rank=-1, world_size=2, local_rank=0,
                                  local_world_size=1, backend="fsdp")).warm_up()
    seen.update(group_after_warm_up=dist.is_initialized(),
                fsdp_imported_after="torch.distributed.fsdp" in sys.modules,
                rng_unchanged=torch.equal(rng, torch.get_rng_state()))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump({**seen, "losses": losses}, f)
    end_rank_process()  # not the interpreter's teardown: see end_rank_process


def test_a_standby_s_warm_up_leaves_no_group_and_the_same_training(tmp_path):
    """FSDPSession.warm_up() (what a standby runs before it knows its rank) in both ranks'
    fresh processes: it imports FSDP2, leaves no process group, and the 2-rank gloo
    training after it computes bit-for-bit what it computes without the warm-up."""
    import json

    import torch.multiprocessing as mp

    runs = {}
    for warm in (True, False):
        out = str(tmp_path / f"warm{warm}")
        mp.start_processes(_warm_then_train, args=(str(tmp_path / f"pg{warm}"), warm, out),
                           nprocs=2, join=True, start_method="spawn")
        runs[warm] = [json.load(open(f"{out}.{r}")) for r in (0, 1)]
    for rank in (0, 1):
        warmed, cold = runs[True][rank], runs[False][rank]
        assert not warmed["fsdp_imported_before"]  # a fresh process: nothing imported yet
        assert warmed["fsdp_imported_after"] and not warmed["group_after_warm_up"]
        assert warmed["rng_unchanged"]
        assert not cold["fsdp_imported_after"]
        assert warmed["losses"] == cold["losses"], rank
    assert runs[True][0]["losses"] != runs[True][1]["losses"]  # each rank its own data


def test_fake_group_refuses_to_replace_a_live_group():
    import torch.distributed as dist

    from dlrover_core.runtime.context import WorkerContext
    from dlrover_plugin_fsdp.backend import FSDPSession

    session = FSDPSession(WorkerContext(job="j", role="t", rank=0, world_size=2, local_rank=0,
                                        local_world_size=1, backend="fsdp"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already initialized"):
            session.warm_up()
        assert dist.get_world_size() == 1  # the live group is untouched
    finally:
        dist.destroy_process_group()
