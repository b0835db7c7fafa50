"""Training runs for the elastic-math tests: real gloo ranks (``torch.multiprocessing``
processes), a small MLP under DDP, a fixed data order, :mod:`dlrover_core.runtime.elastic`.

``run(world_sizes, ...)`` trains ``steps`` optimizer steps; ``world_sizes`` is a list of
``(first_step, world_size)`` segments: the run changes size at those steps, carrying the
model and optimizer state over through a ``torch.save`` file (what a checkpoint restore
does). Returns the global mean loss of every step.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

IN = 16
SEED = 0


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, 1, generator=g)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def _model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(IN, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: no per-step counter in its state, so a DCP state-dict template
    (which initializes optimizer state with a zero-gradient step, as a job's checkpoint
    load does) leaves the first real step unchanged (AdamW's ``step`` would shift)."""
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _worker(rank: int, world: int, store: str, first: int, last: int, global_batch: int,
            micro: int, state_in: str, state_out: str, losses_out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dlrover_core.runtime.elastic import ElasticBatch, accumulation_step
    from dlrover_core.testing import end_rank_process

    torch.set_num_threads(1)
    # a file store, not a TCP port picked beforehand: another process can take a free
    # port before rank 0 binds it
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world)
    model = _model()
    opt = make_optimizer(model)
    if state_in:
        st = torch.load(state_in)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
    ddp = DDP(model)
    x, y = _data(global_batch * last)
    plan = ElasticBatch(global_batch, micro, world)

    def loss_fn(m, batch):
        return torch.nn.functional.mse_loss(m(batch[0]), batch[1])

    losses = []
    for step in range(first, last):
        batches = [(x[r.start:r.stop], y[r.start:r.stop]) for r in plan.micro_ranges(step, rank)]
        losses.append(accumulation_step(ddp, opt, batches, loss_fn))
    if rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, state_out)
        torch.save(losses, losses_out)
    dist.destroy_process_group()
    end_rank_process()  # not the interpreter's teardown: see end_rank_process


def run(segments: list[tuple[int, int]], steps: int, global_batch: int,
        micro: int) -> list[float]:
    """Losses of ``steps`` steps trained in ``segments`` of ``(first_step, world_size)``."""
    out: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        state = ""
        bounds = [s for s, _ in segments[1:]] + [steps]
        for i, ((first, world), last) in enumerate(zip(segments, bounds)):
            nxt = os.path.join(tmp, f"state{i}.pt")
            lpath = os.path.join(tmp, f"loss{i}.pt")
            store = os.path.join(tmp, f"store{i}")
            mp.start_processes(_worker, args=(world, store, first, last, global_batch,
                                              micro, state, nxt, lpath),
                               nprocs=world, join=True, start_method="spawn")
            out += torch.load(lpath)
            state = nxt
    return out
