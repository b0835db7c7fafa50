"""A toy two-modality problem, small enough for tests and for reading.

``ToyPairs``: each sample has a class ``c`` (``id % classes``); modality ``vec`` is
a ``[dim]`` float vector, the class prototype plus noise (an "image"); modality
``tag`` is a short text naming the class in one of three phrasings (a "caption").
The ``prompts`` split of ``tag`` holds one differently phrased text per class, for
zero-shot classification of the ``test`` split of ``vec``.

Roles: ``ToyTextEncoder`` (a frozen bag-of-words embedding with fixed random word
vectors), ``ToyVecEncoder`` (a linear layer; trainable or frozen), ``ToyTrainer``
(CLIP loss on linear projections; reports ``zero_shot_accuracy``). ``ClipLossProbe``:
a workload whose ranks compute :func:`clip_loss` on their rows of given features,
for comparing the all-gathered loss with one process's.

Settings under ``config.toy``: ``step_sleep_s`` (0: extra seconds per train step,
to leave time for a test to act mid-run) and ``trace_dir``: when set, every encoder
output carries a tracer that appends ``<tag> <pid>`` to ``<trace_dir>/trace.log`` in
each process that deserialises it, so a test can see which processes the data
went through. Dataset options (``config.multimodal.data.options``): ``train``
(64), ``test`` (32), ``classes`` (4), ``dim`` (8), ``noise`` (0.3).
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from dlrover_core import BaseWorkload
from dlrover_core.runtime.trace import Tracer
from dlrover_plugin_multimodal.config import MultimodalConfig
from dlrover_plugin_multimodal.contrastive import INIT_LOGIT_SCALE, clip_loss, zero_shot_predict
from dlrover_plugin_multimodal.dataset import MultimodalDataset
from dlrover_plugin_multimodal.encoder import EncoderWorkload
from dlrover_plugin_multimodal.fusion import FusionTrainerWorkload

WIDTH = 16
_PHRASINGS = ("item of class {c}", "class {c} sample", "a member of group {c}")


class ToyPairs(MultimodalDataset):
    modalities = ("vec", "tag")

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        o = self.options
        self.n = {"train": int(o.get("train", 64)), "test": int(o.get("test", 32))}
        self.classes = int(o.get("classes", 4))
        self.dim = int(o.get("dim", 8))
        self.noise = float(o.get("noise", 0.3))
        g = torch.Generator().manual_seed(1234)
        self.prototypes = torch.randn(self.classes, self.dim, generator=g)
        self.n["prompts"] = self.classes

    def sample_ids(self, split: str) -> list[int]:
        if split not in self.n:
            raise KeyError(f"ToyPairs has splits train, test, prompts; not {split!r}")
        return list(range(self.n[split]))

    def label(self, split: str, i: int) -> int:
        return int(i) % self.classes

    def load(self, modality: str, split: str, ids: Sequence[int]) -> Any:
        if modality == "vec":
            if split == "prompts":
                raise KeyError("the prompts split has no vec samples")
            rows = []
            for i in ids:
                g = torch.Generator().manual_seed(zlib.crc32(f"{split}/{i}".encode()))
                rows.append(self.prototypes[self.label(split, i)]
                            + self.noise * torch.randn(self.dim, generator=g))
            return torch.stack(rows)
        if split == "prompts":
            return [f"which is {self.label(split, i)}" for i in ids]
        return [_PHRASINGS[int(i) % 3].format(c=self.label(split, i)) for i in ids]

    def eval_inputs(self) -> dict[str, tuple[str, list[int]]]:
        return {"vec": ("test", self.sample_ids("test")),
                "tag": ("prompts", self.sample_ids("prompts"))}


class BagOfWords(torch.nn.Module):
    """Mean of fixed random word vectors (words hashed into ``buckets``)."""

    def __init__(self, buckets: int = 97, width: int = WIDTH) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.table = torch.nn.Parameter(torch.randn(buckets, width, generator=g))
        self.buckets = buckets

    def forward(self, texts: list[str]) -> torch.Tensor:
        rows = []
        for t in texts:
            idx = torch.tensor([zlib.crc32(w.encode()) % self.buckets for w in t.split()])
            rows.append(self.table[idx].mean(dim=0))
        return torch.stack(rows)


class _Traced:
    def _traced(self, out: dict[str, Any]) -> dict[str, Any]:
        trace_dir = (self.config.get("toy") or {}).get("trace_dir")
        if trace_dir:
            out["trace"] = Tracer(os.path.join(trace_dir, "trace.log"),
                                  f"{self.role}-{self.rank}")
        return out

    def embed(self, split, ids):
        return self._traced(super().embed(split, ids))

    def inputs(self, split, ids):
        return self._traced(super().inputs(split, ids))


class ToyTextEncoder(_Traced, EncoderWorkload):
    @classmethod
    def build_encoder(cls, config: Any) -> torch.nn.Module:
        return BagOfWords()


class ToyVecEncoder(_Traced, EncoderWorkload):
    @classmethod
    def build_encoder(cls, config: Any) -> torch.nn.Module:
        dim = int(MultimodalConfig.from_config(config).data_options.get("dim", 8))
        g = torch.Generator().manual_seed(11)
        layer = torch.nn.Linear(dim, WIDTH)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(WIDTH, dim, generator=g) / dim ** 0.5)
            layer.bias.zero_()
        return layer


class ToyClip(torch.nn.Module):
    def __init__(self, encoders: torch.nn.ModuleDict) -> None:
        super().__init__()
        self.encoders = encoders
        self.vec_proj = torch.nn.Linear(WIDTH, WIDTH)
        self.tag_proj = torch.nn.Linear(WIDTH, WIDTH)
        self.logit_scale = torch.nn.Parameter(torch.tensor(INIT_LOGIT_SCALE))

    def features(self, modality: str, x: torch.Tensor) -> torch.Tensor:
        if modality in self.encoders:  # trainable: raw inputs through the encoder
            x = self.encoders[modality](x)
        return getattr(self, f"{modality}_proj")(x)

    def forward(self, vec: torch.Tensor, tag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.features("vec", vec), self.features("tag", tag)


class ToyTrainer(FusionTrainerWorkload):
    def build_model(self, encoders):
        return ToyClip(encoders)

    def build_optimizer(self, model):
        return torch.optim.Adam(model.parameters(), lr=float(self.config.get("lr", 0.02)))

    def compute_loss(self, batch):
        sleep = float((self.config.get("toy") or {}).get("step_sleep_s", 0.0))
        if sleep:
            time.sleep(sleep)
        vec, tag = self.model(batch["vec"], batch["tag"])
        return clip_loss(vec, tag, self.unwrapped.logit_scale)

    def evaluate_batch(self, batch):
        m = self.unwrapped
        pred = zero_shot_predict(m.features("vec", batch["vec"]), m.features("tag", batch["tag"]))
        labels = torch.tensor([self.dataset.label("test", int(i)) for i in batch["vec_ids"]])
        # prompt row j names class label("prompts", j) = j
        return {"zero_shot_accuracy": float((pred == labels).float().mean())}


class ClipLossProbe(BaseWorkload):
    """Each rank takes its contiguous ``N / world_size`` rows of the features."""

    def clip_loss_grads(self, image: torch.Tensor, text: torch.Tensor,
                        logit_scale: torch.Tensor) -> dict[str, Any]:
        """``clip_loss`` on this rank's rows (gathered across the role's ranks), then
        backward: the loss, the gradients of this rank's image and text rows and of
        the logit scale, and the metrics."""
        n = image.shape[0] // self.world_size
        rows = slice(self.rank * n, (self.rank + 1) * n)
        a = image[rows].clone().requires_grad_(True)
        b = text[rows].clone().requires_grad_(True)
        s = logit_scale.clone().requires_grad_(True)
        loss, metrics = clip_loss(a, b, s)
        loss.backward()
        return {"loss": loss.detach(), "image_grad": a.grad, "text_grad": b.grad,
                "scale_grad": s.grad, **metrics}
