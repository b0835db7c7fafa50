"""A plain torchrun script: a character-level MLP language model on the Python
reference manual (``pydoc_data.topics``, shipped with CPython), trained with DDP over
gloo on the CPU. It knows nothing of dlrover; run it either way:

    torchrun --nproc_per_node 2 train.py --steps 200
    dlrover-run --nproc_per_node 2 train.py --steps 200

It saves its own snapshot (model, optimizer, step; ``torch.save`` to a temporary file,
then an atomic rename) every ``--save-every`` steps, and resumes from it when it starts,
so a restarted group (``--max-restarts``) goes on where the snapshot left off. Every
random choice is a function of (seed, step, rank), so a resumed run reaches the same
final loss as an uninterrupted one.

Model: the previous ``--context`` characters, each embedded in 32 dimensions,
concatenated, then Linear(context*32, 256) - GELU - Linear(256, vocab); cross-entropy
in nats per character. Data: the topics joined in key order; the last 10% is held out.
The final loss is the held-out loss on 1,024 fixed windows, computed by rank 0.
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
from torch.nn.parallel import DistributedDataParallel as DDP


def load_text() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


class CharMLP(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(context * dim, hidden)
        self.fc2 = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, context) int64
        h = self.embed(x).flatten(1)
        return self.fc2(F.gelu(self.fc1(h)))  # (batch, vocab) logits


def windows(data: torch.Tensor, starts: torch.Tensor, context: int):
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, -1]


def save_snapshot(path: str, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = f"{path}.tmp"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32, help="windows per rank per step")
    p.add_argument("--context", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snapshot", default="snapshot.pt", help="snapshot file ('' = none)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--out", default="", help="rank 0 writes the final loss here (JSON)")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to sleep per step (demos and fault-injection tests)")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    text = load_text()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    data = torch.tensor([index[c] for c in text])
    split = int(len(data) * 0.9)
    train, held = data[:split], data[split:]

    torch.manual_seed(args.seed)
    model = DDP(CharMLP(len(vocab), args.context))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.snapshot and os.path.exists(args.snapshot):
        snap = torch.load(args.snapshot, weights_only=True)
        model.module.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        start = snap["step"]
        print(f"rank {rank}: resumed from step {start} (restart {restart})", flush=True)

    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 101 + rank)
        starts = torch.randint(0, len(train) - args.context - 1, (args.batch,), generator=g)
        x, y = windows(train, starts, args.context)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done = step + 1
        if rank == 0 and done % 20 == 0:
            print(f"step {done} loss {loss.item():.4f}", flush=True)
        if args.snapshot and rank == 0 and done % args.save_every == 0 and done < args.steps:
            save_snapshot(args.snapshot, model.module, opt, done)
        dist.barrier()  # nobody runs ahead of the snapshot it may resume from

    if rank == 0:
        g = torch.Generator().manual_seed(12345)
        starts = torch.randint(0, len(held) - args.context - 1, (1024,), generator=g)
        x, y = windows(held, starts, args.context)
        with torch.no_grad():
            final = F.cross_entropy(model.module(x), y).item()
        print(f"final held-out loss {final:.6f} after {args.steps} steps", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"final_loss": final, "steps": args.steps, "world_size": world,
                           "resumed_from": start, "restart_count": restart}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
