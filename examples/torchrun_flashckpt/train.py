"""A torchrun script with flash checkpoints (``dlrover_plugin_flashckpt.FlashCheckpointer``):
a small MLP learns a fixed random teacher network (regression, mean squared error) with
DDP over gloo on the CPU, or FSDP2 (``--fsdp``: ``fully_shard`` on a CPU device mesh).
Run it under dlrover-run, which gives it a Ray cluster for the checkpoint persister:

    dlrover-run --nproc_per_node 2 --max-restarts 1 train.py --steps 200

Every ``--save-every`` steps it saves model and optimizer state
(torch.distributed.checkpoint's ``get_state_dict``, the same code for DDP and FSDP2)
into shared memory in memcpy time; every ``--persist-every``-th step goes to
``--ckpt-dir`` on disk too. When a rank dies, dlrover-run restarts the group's
processes and ``load`` restores the newest step from memory (from disk after a node or
job restart). Every random choice is a function of (seed, step, rank), so a resumed run
reaches the final loss of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dlrover_plugin_flashckpt import FlashCheckpointer

IN, HIDDEN, OUT = 16, 64, 4


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(seed: int, step: int, rank: int, size: int, teacher: nn.Module):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(size, IN, generator=g)
    with torch.no_grad():
        return x, teacher(x)


def wrap(model: nn.Module, fsdp: bool) -> nn.Module:
    if not fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP")
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--persist-every", type=int, default=50,
                   help="every n-th step also goes to disk (a multiple of --save-every)")
    p.add_argument("--out", default="", help="rank 0 writes the result here (JSON)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to sleep per step (demos and fault-injection tests)")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(1234)
    teacher = mlp()
    torch.manual_seed(args.seed)
    model = wrap(mlp(), args.fsdp)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    ckpt = FlashCheckpointer(args.ckpt_dir, persist_every_steps=args.persist_every)
    model_sd, optim_sd = get_state_dict(model, opt)  # also creates Adam's state
    state = {"model": model_sd, "optim": optim_sd}
    start = ckpt.load(state) or 0
    if start:
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        print(f"rank {rank}: resumed from step {start} ({ckpt.last_load_source}, "
              f"restart {restart})", flush=True)

    saved = []
    for step in range(start, args.steps):
        x, y = batch(args.seed, step, rank, args.batch, teacher)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done = step + 1
        if done % args.save_every == 0 and done < args.steps:
            model_sd, optim_sd = get_state_dict(model, opt)
            ckpt.save(done, {"model": model_sd, "optim": optim_sd})
            saved.append(done)
            print(f"rank {rank}: saved step {done} loss {loss.item():.6f}", flush=True)

    x, y = batch(args.seed, 10**6, 0, 1024, teacher)  # the same held-out batch everywhere
    with torch.no_grad():
        final = F.mse_loss(model(x), y).item()
    if rank == 0:
        print(f"final loss {final:.6f} after {args.steps} steps", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"final_loss": final, "steps": args.steps, "resumed_from": start,
                           "source": ckpt.last_load_source, "restart_count": restart,
                           "saved": saved}, f)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
