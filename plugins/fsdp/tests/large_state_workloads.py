"""The workload of ``test_fsdp_large_state`` (imported by Ray workers as
``plugins.fsdp.tests.large_state_workloads``): a model whose training state is about
1 GiB per rank of 2."""

from __future__ import annotations

import json
import os
import signal

import torch

from dlrover_core import BaseWorkload
from dlrover_core.runtime.elastic import accumulation_step

#: width and depth of the model: 11 Linear(4096, 4096) layers, 184.6 M float32
#: parameters; with AdamW's two moments, 2.06 GiB of state in all, 1.03 GiB per rank
WIDTH, LAYERS = 4096, 11


class Wide(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH)
                                          for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def batch(step: int, rank: int) -> torch.Tensor:
    """Inputs ``[2, WIDTH]`` of ``rank`` at ``step`` (seeded by both)."""
    return torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


class LargeState(BaseWorkload):
    """A job workload (``run()``): :class:`Wide` sharded by FSDP2 (one ``fully_shard``
    per layer), AdamW, ``config.max_steps`` steps, saving every
    ``checkpoint.every_steps``. On the first attempt, rank ``config.kill_rank``
    SIGKILLs itself right after the save of ``config.kill_step`` (after a barrier: every
    rank saved it), having written its digest of the saved state to
    ``<config.out>/saved-<rank>.json``. Each attempt that loads writes
    ``loaded-<rank>-<attempt>.json``: the step and source of the load and the digest of
    the loaded state. A digest: the float64 sum and the sum of squares of every local
    tensor of the state (parameter shards, both AdamW moments, the steps), and the
    state's local bytes."""

    def setup(self) -> None:
        torch.manual_seed(0)
        torch.set_num_threads(1)  # two ranks on two cores
        self.model = self.backend.wrap(Wide(), shard_modules=(torch.nn.Linear,))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.extra = {"step": 0}
        loaded = self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra)
        if loaded is not None:
            self._write(f"loaded-{self.rank}-{self.attempt}",
                        {"step": loaded, "source": self.checkpointer.saver.last_load_source,
                         **self.digest()})

    def digest(self) -> dict:
        total, squares, nbytes = 0.0, 0.0, 0
        tensors = [p for p in self.model.parameters()]
        for st in self.opt.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            d = local.detach().double()
            total += float(d.sum())
            squares += float(d.pow(2).sum())
            nbytes += local.numel() * local.element_size()
        return {"sum": total, "squares": squares, "bytes": nbytes}

    def _write(self, name: str, data: dict) -> None:
        path = os.path.join(str(self.config.out), f"{name}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)

    def run(self) -> dict:
        import torch.distributed as dist

        c = self.config
        step = int(self.extra["step"])
        while step < int(c.max_steps):
            loss = accumulation_step(self.model, self.opt, [batch(step, self.rank)], loss_fn)
            step += 1
            self.extra["step"] = step
            self.report(step - 1, loss=loss)
            saved = self.checkpointer.maybe_save(step, model=self.model, optimizer=self.opt,
                                                 extra=self.extra)
            if saved and step == int(c.kill_step) and self.attempt == 0:
                self._write(f"saved-{self.rank}", {"step": step, **self.digest()})
                dist.barrier()
                if self.rank == int(c.kill_rank):
                    os.kill(os.getpid(), signal.SIGKILL)
        return {"steps": step, "loss": loss}
