"""Dynamic data sharding from a plain torchrun script run as a script role (real local
Ray, 2 ranks in a real gloo group, a real SIGKILL of rank 1's script process): the script
leases its batches through ``ShardSampler.for_script`` and ``ShardBatchSampler`` and keeps
the shard state in its own checkpoint. The model is one weight per sample and each
sample's gradient adds exactly 1 to its weight, so the final model itself shows how many
times each sample's gradient is in it."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from tests.script_jobs import run_two_ranks

N, BATCH, EVERY, KILL_AT = 96, 4, 3, 7

SCRIPT = '''
import json, os, signal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from dlrover_core.runtime.sharding import ShardBatchSampler, ShardSampler

N, BATCH, EVERY, KILL_AT = %d, %d, %d, %d


def main():
    dist.init_process_group("gloo")  # env:// from the role's torchrun variables
    rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    sampler = ShardSampler.for_script(batch_size=BATCH, num_samples=N, batches_per_shard=2)
    w = torch.zeros(N, requires_grad=True)
    opt = torch.optim.SGD([w], lr=1.0)
    start = 0
    if os.path.exists("ckpt.pt"):  # the checkpoint holds steps 0..start-1
        ck = torch.load("ckpt.pt")
        with torch.no_grad():
            w.copy_(ck["w"])
        start = ck["step"]
        sampler.load_state_dict(ck["shards"])
    sampler.restore(start - 1)
    batches = iter(DataLoader(torch.arange(N), batch_sampler=ShardBatchSampler(sampler)))
    step = start
    while True:
        if rank == 1 and restart == 0 and step == KILL_AT:
            sampler.flush()  # the master has every report the ids log has
            os.kill(os.getpid(), signal.SIGKILL)
        idx = next(batches, None)
        more = torch.tensor([0 if idx is None else 1])
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            break
        ids = [] if idx is None else idx.tolist()
        opt.zero_grad()
        (-(w[ids].sum()) if ids else w.sum() * 0.0).backward()
        dist.all_reduce(w.grad)  # each sample's gradient adds 1 to its weight
        opt.step()
        sampler.step_done(step)
        with open("ids-%%d.jsonl" %% rank, "a") as f:
            f.write(json.dumps({"restart": restart, "step": step, "ids": ids}) + "\\n")
        step += 1
        if step %% EVERY == 0:
            shards = sampler.state_dict()  # a collective: every rank
            if rank == 0:
                torch.save({"w": w.detach(), "step": step, "shards": shards}, "ckpt.tmp")
                os.replace("ckpt.tmp", "ckpt.pt")
            dist.barrier()
    if rank == 0:
        torch.save(w.detach(), "final.pt")
    dist.destroy_process_group()
    return 0
''' % (N, BATCH, EVERY, KILL_AT)


@pytest.mark.slow
def test_script_role_trains_each_sample_once_across_a_sigkill(ray_cluster, tmp_path,
                                                              monkeypatch):
    summary = run_two_ranks(tmp_path, monkeypatch, "script-shards", "shard_script.py", SCRIPT,
                            "shard_script:main")
    assert summary["restarts"]["total"] == 1
    final_w = torch.load(tmp_path / "final.pt")
    assert final_w.tolist() == [1.0] * N  # every sample's gradient once in the final model
    records = [json.loads(line) for r in (0, 1)
               for line in (tmp_path / f"ids-{r}.jsonl").read_text().splitlines()]
    restart_at = min(r["step"] for r in records if r["restart"] == 1)
    assert restart_at == KILL_AT - KILL_AT % EVERY  # the newest checkpoint: steps 0..5
    final, reread = collections.Counter(), 0
    for r in records:
        if r["restart"] == 0 and r["step"] >= restart_at:
            reread += len(r["ids"])  # rolled back by the restore
        else:
            final.update(r["ids"])
    assert sorted(final) == list(range(N)) and set(final.values()) == {1}
    assert reread == (KILL_AT - restart_at) * 2 * BATCH
    ledger = summary["shards"]["trainer"]
    assert summary["samples_lost"] == 0 and summary["samples_duplicated"] == 0
    assert ledger["samples_reread_after_rollback"] == reread
    assert ledger["samples_trained"] == N
