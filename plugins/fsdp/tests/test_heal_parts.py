"""The parts of the heal (``dlrover_core.checkpoint.heal``) without a job: what a rank's
checkpointer notes and keeps, and the collective that moves a survivor's live state to a
fresh DDP rank (two spawned processes, gloo)."""

from __future__ import annotations

import torch

from dlrover_core.checkpoint.checkpointer import Checkpointer
from dlrover_core.testing.tensors import end_rank_process
from dlrover_plugin_fsdp.engine import DCPEngine


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 2))


def _step(model, opt) -> None:
    loss = model(torch.randn(4, 6)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_live_state_is_the_noted_step_until_a_parameter_moves():
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    extra = {"step": 0}
    ck = Checkpointer(saver=None, engine=DCPEngine(), every_steps=0,  # notes, never saves
                      track_live=True)
    assert ck.live_state() is None  # nothing noted yet
    _step(model, opt)
    extra["step"] = 1
    assert ck.maybe_save(1, model=model, optimizer=opt, extra=extra) is False
    weights = model[0].weight.detach().clone()
    rng = torch.get_rng_state()
    torch.rand(3)  # the random state moves on after the note
    extra["step"] = 99  # so does the workload's dict
    live = ck.live_state()
    assert live.step == 1 and live.state["extra"] == {"step": 1}
    assert torch.equal(live.state["model"]["0.weight"], weights)
    assert torch.equal(live.rng, rng)
    assert live.state["optimizer"]["state"]  # AdamW's moments of step 1
    _step(model, opt)  # an optimizer step after the note: the objects are past step 1
    assert ck.live_state() is None


def _heal_rank(rank: int, store: str, out: str) -> None:
    import copy

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dlrover_core.checkpoint.heal import heal

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model = DistributedDataParallel(_model(rank))  # DDP takes rank 0's initial weights
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    extra = {"step": 0}
    ck = Checkpointer(saver=None, engine=DCPEngine(), every_steps=0, track_live=True)
    if rank == 0:  # the survivor: 3 steps alone (no all-reduce), noted as step 3
        with model.no_sync():
            for _ in range(3):
                _step(model, opt)
        extra["step"] = 3
        ck.maybe_save(3, model=model, optimizer=opt, extra=extra)
        want = {"model": {k: v.clone() for k, v in model.module.state_dict().items()},
                "opt": copy.deepcopy(opt.state_dict()), "rng": torch.get_rng_state()}
        live = ck.live_state()
        torch.rand(5)  # its random state moves on; the heal puts back the noted one
    else:  # the replacement: a fresh model and optimizer, another random state
        torch.manual_seed(7)
        live, want = None, None
    # both ranks make new objects (the survivor's re-setup does too) and heal into them
    model2 = DistributedDataParallel(_model(11))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
    extra2 = {"step": 0}
    got = heal(live, DCPEngine(), {"model": model2, "optimizer": opt2, "extra": extra2},
               torch.device("cpu"))
    torch.save({"got": got, "extra": extra2, "rng": torch.get_rng_state(), "want": want,
                "model": model2.module.state_dict(), "opt": opt2.state_dict()},
               f"{out}.{rank}")
    del model, model2
    dist.destroy_process_group()
    end_rank_process()


def test_heal_gives_every_rank_the_survivor_s_state_bit_for_bit(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "heal")
    mp.start_processes(_heal_rank, args=(str(tmp_path / "pg"), out), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = (torch.load(f"{out}.{r}", weights_only=False) for r in (0, 1))
    assert r0["got"] == r1["got"] == (3, 0)  # step 3, from rank 0
    assert r0["extra"] == r1["extra"] == {"step": 3}
    for k, v in r0["want"]["model"].items():
        assert torch.equal(r0["model"][k], v) and torch.equal(r1["model"][k], v), k
    want_opt = r0["want"]["opt"]["state"]
    for r in (r0, r1):  # the optimizer's moments and step counts: the survivor's
        assert r["opt"]["state"].keys() == want_opt.keys() and want_opt
        for i, st in want_opt.items():
            for name, t in st.items():
                assert torch.equal(r["opt"]["state"][i][name], t), (i, name)
        assert float(r["opt"]["state"][0]["step"]) == 3.0
        assert torch.equal(r["rng"], r0["want"]["rng"])  # the survivor's noted random state
