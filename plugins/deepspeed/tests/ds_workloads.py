"""Workloads used by this plugin's tests; not installed (the workers of a test's Ray
cluster import them as ``plugins.deepspeed.tests.ds_workloads``: the current directory,
the repository's root, is on their ``PYTHONPATH``)."""

from __future__ import annotations

import torch

from dlrover_core import BaseWorkload


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _clone(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return type(v)((k, _clone(x)) for k, x in v.items())
    if isinstance(v, list):
        return [_clone(x) for x in v]
    if isinstance(v, tuple) and not hasattr(v, "_fields"):
        return tuple(_clone(x) for x in v)
    return v


class ZeroTrainer(BaseWorkload):
    """A tiny regression model under DeepSpeed ZeRO (``config.stage``, default 2) with a
    torch AdamW. Methods are called by the tests through the host's ``call``."""

    def setup(self) -> None:
        stage = int(self.config.get("stage", 2))
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.engine = self.backend.wrap(model, optimizer=opt, config={
            "train_micro_batch_size_per_gpu": 8,
            "zero_optimization": {"stage": stage},
            "gradient_clipping": 1.0})
        self.extra = {"step": 0}

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        x = torch.randn(8, 16, generator=g)
        return x, x[:, :4].sin()

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            x, y = self.batch(self.extra["step"])
            loss = torch.nn.functional.mse_loss(self.engine(x), y)
            self.engine.backward(loss)
            self.engine.step()
            self.extra["step"] += 1
            losses.append(float(loss))
        return losses

    def objects(self) -> dict:
        return {"model": self.engine, "extra": self.extra}

    def save(self, step: int) -> float:
        return self.checkpointer.save(step, **self.objects())

    def load(self) -> int | None:
        return self.checkpointer.load(**self.objects())

    def snapshot(self) -> None:
        """Keep a copy of the engine's state dict (tensors cloned)."""
        from dlrover_plugin_deepspeed.engine import DeepSpeedEngineState

        self._snap = _clone(DeepSpeedEngineState().state_dict(self.objects()))

    def restore(self) -> None:
        """Load the snapshot back through the engine."""
        from dlrover_plugin_deepspeed.engine import DeepSpeedEngineState

        DeepSpeedEngineState().load_state_dict(self.objects(), _clone(self._snap))

    def flat_state(self) -> dict:
        """Every tensor of the engine's state dict, flattened to ``path -> tensor``."""
        from dlrover_plugin_deepspeed.engine import DeepSpeedEngineState

        out: dict = {}

        def walk(prefix: str, v: object) -> None:
            if isinstance(v, torch.Tensor):
                out[prefix] = v.detach().clone()
            elif isinstance(v, dict):
                for k, x in v.items():
                    walk(f"{prefix}.{k}", x)
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    walk(f"{prefix}.{i}", x)

        walk("", DeepSpeedEngineState().state_dict(self.objects()))
        return out
