"""scikit-learn's handwritten digits as image-caption pairs.

The images are the 1,797 8x8 scans (16 grey levels) of the UCI "Optical Recognition
of Handwritten Digits" set that ship inside scikit-learn (``load_digits``). Each
image gets a caption written from its label in one of eight phrasings (picked by
the sample id, so every process writes the same one). A seeded 20% of the images
is held out (``test``); the ``prompts`` split holds ten zero-shot prompts, "a photo
of the digit N", a phrasing no caption uses.

Splits: ``train`` and ``test`` (ids index the image set), ``prompts`` (ids 0-9 are
the digits). Options (``config.multimodal.data.options``): ``test_fraction`` (0.2),
``split_seed`` (0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from dlrover_plugin_multimodal.dataset import MultimodalDataset

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

#: Caption phrasings of the training pairs ({n}: the numeral, {w}: the word).
CAPTIONS = (
    "a handwritten {w}",
    "the number {n}",
    "a scan of a handwritten {n}",
    "an image of the numeral {w}",
    "{w}, written by hand",
    "a small picture showing {w}",
    "digit {n}",
    "a pen drawing of the number {w}",
)

#: The zero-shot prompt, never a training caption.
PROMPT = "a photo of the digit {n}"


def caption(label: int, sample_id: int) -> str:
    """The caption of sample ``sample_id`` whose digit is ``label``."""
    template = CAPTIONS[(sample_id * 7919) % len(CAPTIONS)]
    return template.format(w=WORDS[label], n=label)


class DigitCaptions(MultimodalDataset):
    """Modalities ``image`` (``[n, 64]`` float32 in [0, 1]) and ``text`` (captions or
    prompts, lists of str)."""

    modalities = ("image", "text")

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        from sklearn.datasets import load_digits

        digits = load_digits()
        self.images = (digits.data / 16.0).astype(np.float32)  # [1797, 64]
        self.labels = digits.target.astype(np.int64)
        frac = float(self.options.get("test_fraction", 0.2))
        if not 0.0 < frac < 1.0:
            raise ValueError(f"config.multimodal.data.options.test_fraction={frac}; "
                             "allowed: a number in (0, 1)")
        perm = np.random.default_rng(int(self.options.get("split_seed", 0))).permutation(
            len(self.labels))
        n_test = round(frac * len(perm))
        self.splits = {"test": sorted(perm[:n_test].tolist()),
                       "train": sorted(perm[n_test:].tolist()),
                       "prompts": list(range(10))}

    def sample_ids(self, split: str) -> list[int]:
        if split not in self.splits:
            raise KeyError(f"DigitCaptions has splits {', '.join(self.splits)}; not {split!r}")
        return list(self.splits[split])

    def label(self, split: str, i: int) -> int:
        """The digit of sample ``i`` of ``split``."""
        return int(i) if split == "prompts" else int(self.labels[int(i)])

    def load(self, modality: str, split: str, ids: Sequence[int]) -> Any:
        ids = [int(i) for i in ids]
        if modality == "image":
            if split == "prompts":
                raise KeyError("the prompts split has text only")
            return self.images[ids]
        if split == "prompts":
            return [PROMPT.format(n=i) for i in ids]
        return [caption(int(self.labels[i]), i) for i in ids]

    def eval_inputs(self) -> dict[str, tuple[str, list[int]]]:
        """Zero-shot evaluation: the held-out images and the ten prompts."""
        return {"image": ("test", self.sample_ids("test")),
                "text": ("prompts", self.sample_ids("prompts"))}
