"""The workload of ``test_fsdp_large_state`` (imported by Ray workers as
``plugins.fsdp.tests.large_state_workloads``): a model whose training state is about
1 GiB per rank of 2 (2 GiB at world size 1)."""

from __future__ import annotations

import hashlib
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


def tensor_digest(t: torch.Tensor, rank: int, world_size: int) -> dict:
    """The sha256 of the bytes of ``t``'s local part on ``rank`` of ``world_size``
    (``hex``), its local ``shape`` and the ``rows`` ``[start, end)`` of the full
    tensor's dim 0 it holds: FSDP2's ``Shard(0)`` splits dim 0 as ``torch.chunk`` does
    (``ceil(n / world_size)`` rows a rank); a plain tensor (AdamW's ``step``) is whole
    on every rank. Raises ``AssertionError`` when the local part is not that split."""
    local = t.to_local() if hasattr(t, "to_local") else t
    local = local.detach().contiguous()
    if hasattr(t, "to_local") and t.dim() > 0:
        n = t.shape[0]
        chunk = -(-n // world_size)
        start = min(rank * chunk, n)
        end = min(start + chunk, n)
        assert local.shape[0] == end - start, (t.shape, local.shape, rank, world_size)
    else:
        start, end = 0, (t.shape[0] if t.dim() > 0 else 0)
    data = local.view(-1).view(torch.uint8).numpy()
    return {"hex": hashlib.sha256(memoryview(data)).hexdigest(),
            "shape": list(local.shape), "rows": [start, end]}


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
    state's local bytes. With ``config.tensor_digests: true`` the digest also has
    ``tensors``: per tensor of the state (``<param name>`` and
    ``<param name>.<exp_avg|exp_avg_sq|step>``), :func:`tensor_digest` of the rank's
    local part. With ``config.slices_of: W`` a load's digest also has ``slices``: per
    tensor, a list of W ``{"hex", "rows"}``, the sha256 of the full tensor's dim-0
    rows that rank r of W held (the same split as :func:`tensor_digest`; the tensor
    must be whole here, as at world size 1)."""

    def setup(self) -> None:
        torch.manual_seed(0)
        torch.set_num_threads(1)  # two ranks on two cores
        self.model = self.backend.wrap(Wide(), shard_modules=(torch.nn.Linear,))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.extra = {"step": 0}
        loaded = self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra)
        if loaded is not None:
            data = {"step": loaded, "source": self.checkpointer.saver.last_load_source,
                    "world_size": self.world_size, **self.digest()}
            if self.config.get("slices_of"):
                data["slices"] = self.slices(int(self.config.slices_of))
            self._write(f"loaded-{self.rank}-{self.attempt}", data)

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
        out = {"sum": total, "squares": squares, "bytes": nbytes}
        if self.config.get("tensor_digests", False):
            out["tensors"] = {name: tensor_digest(t, self.rank, self.world_size)
                              for name, t in self.named_state().items()}
        return out

    def slices(self, world_size: int) -> dict[str, list[dict]]:
        """Per tensor of the state (whole on this rank), the sha256 and ``rows`` of
        the part that each rank of ``world_size`` holds under FSDP2's split."""
        out = {}
        for name, t in self.named_state().items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            full = full.detach().contiguous()
            parts = []
            for r in range(world_size):
                if full.dim() == 0:
                    part, rows = full, [0, 0]
                else:
                    n = full.shape[0]
                    chunk = -(-n // world_size)
                    start = min(r * chunk, n)
                    rows = [start, min(start + chunk, n)]
                    part = full[rows[0]:rows[1]]
                data = part.contiguous().view(-1).view(torch.uint8).numpy()
                parts.append({"hex": hashlib.sha256(memoryview(data)).hexdigest(),
                              "rows": rows})
            out[name] = parts
        return out

    def named_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the training state by name: the parameters and, per
        parameter, AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``."""
        named = dict(self.model.named_parameters())
        names = {id(p): n for n, p in named.items()}
        for p, st in self.opt.state.items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    named[f"{names[id(p)]}.{key}"] = v
        return named

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
