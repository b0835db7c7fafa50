"""A small workload for the ``gpu``-marked tests (tests/test_gpu.py): trains a tiny MLP
on the backend's device for ``config.steps`` steps and writes down where it ran."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload


class CudaTrain(BaseWorkload):
    def setup(self) -> None:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                  torch.nn.Linear(32, 1))
        self.model = self.backend.wrap(net)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def run(self) -> dict:
        dev = self.backend.device
        g = torch.Generator(device=dev).manual_seed(self.rank)
        losses = []
        for step in range(int(self.config.get("steps", 30))):
            x = torch.randn(32, 16, device=dev, generator=g)
            loss = torch.nn.functional.mse_loss(self.model(x), x.sum(1, keepdim=True) / 4)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            t = loss.detach().clone()
            dist.all_reduce(t)   # on the backend's device: NCCL
            losses.append(t.item() / self.world_size)
            self.report(step, loss=losses[-1])
        param = next(self.model.parameters())
        info = {"role": self.role, "rank": self.rank, "device": str(dev),
                "current_device": torch.cuda.current_device(),
                "cuda_device": self.context.cuda_device, "gpu_ids": self.context.gpu_ids,
                "uuid": str(torch.cuda.get_device_properties(dev).uuid),
                "param_device": str(param.device), "dist_backend": dist.get_backend(),
                "losses": losses}
        out = os.path.join(self.job_dir, "probe")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{self.role}-{self.rank}.json"), "w") as f:
            json.dump(info, f)
        return {"loss": losses[-1]}
