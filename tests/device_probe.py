"""A workload that writes down which GPUs it sees (for tests/scenarios/fake_gpus.py,
on a Ray cluster whose GPUs are Ray resources only)."""

from __future__ import annotations

import json
import os

import ray

from dlrover_core import BaseWorkload


class DeviceProbe(BaseWorkload):
    def run(self):
        ctx = ray.get_runtime_context()
        gpu = float(ctx.get_assigned_resources().get("GPU", 0.0))
        cuda = self.context.cuda_device
        info = {"role": self.role, "rank": self.rank,
                "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "LOCAL_RANK": os.environ.get("LOCAL_RANK"),
                "ray_gpu_ids": sorted(str(i) for i in ray.get_gpu_ids()),
                "gpu": gpu, "device": "cpu" if cuda is None else f"cuda:{cuda}",
                "collocation": self.get_device_collocation()}
        out = os.path.join(self.job_dir, "probe")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{self.role}-{self.rank}.json"), "w") as f:
            json.dump(info, f)
        self.report(0, gpu=gpu)
