"""scikit-learn's handwritten digits as image-caption pairs, some digits held out.

The images are the 1,797 8x8 scans (16 grey levels) of the UCI "Optical Recognition
of Handwritten Digits" set that ship inside scikit-learn (``load_digits``). Each
image gets a caption written from its label in one of eight phrasings (picked by
the sample id, so every process writes the same one). A seeded 20% of the images
is held out (``test``). Only images of the ``train_digits`` (0-6, fixed before any
result was seen) are trained on: digits 7, 8 and 9 are unseen classes, neither their
images nor their captions appear in training.

The ``prompts`` split holds the evaluation prompts: every digit in each of the
:data:`EVAL_TEMPLATES`, which share no word pair (bigram, :func:`word_pairs`) with any
training caption of any digit.

Splits: ``train`` (ids of training images of the train digits), ``test`` (every
held-out image, all ten digits), ``prompts`` (id ``j``: digit ``j % 10`` in template
``j // 10``). Options (``config.multimodal.data.options``): ``test_fraction`` (0.2),
``split_seed`` (0), ``train_digits`` ([0, 1, 2, 3, 4, 5, 6]).
"""

from __future__ import annotations

import re
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

#: Evaluation prompt templates, averaged per digit (a prompt ensemble). None shares a
#: word pair with a training caption of any digit (tests/test_parts.py checks it).
EVAL_TEMPLATES = (
    "a photo of {w}",
    "this is the figure {n}",
    "{w} drawn in ink",
    "the symbol for {w}",
    "an example of class {n}",
)

#: The digits whose images and captions are trained on (the rest are unseen classes);
#: fixed before any result was seen.
TRAIN_DIGITS = (0, 1, 2, 3, 4, 5, 6)


def caption(label: int, sample_id: int) -> str:
    """The caption of sample ``sample_id`` whose digit is ``label``."""
    template = CAPTIONS[(sample_id * 7919) % len(CAPTIONS)]
    return template.format(w=WORDS[label], n=label)


def prompt(digit: int, template: int) -> str:
    """Evaluation prompt ``template`` (an index of :data:`EVAL_TEMPLATES`) for ``digit``."""
    return EVAL_TEMPLATES[template].format(w=WORDS[digit], n=digit)


def word_pairs(text: str) -> set[tuple[str, str]]:
    """The adjacent word pairs (bigrams) of ``text``: lower-cased runs of letters and
    digits, punctuation dropped ("seven, written" -> ``("seven", "written")``)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return set(zip(words, words[1:]))


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
        digits = self.options.get("train_digits", list(TRAIN_DIGITS))
        try:
            seen = sorted({int(d) for d in digits})
        except (TypeError, ValueError):
            seen = []
        if not seen or not set(seen) <= set(range(10)) or len(seen) == 10:
            raise ValueError(f"config.multimodal.data.options.train_digits={digits!r}; "
                             "allowed: a non-empty list of digits 0-9 that leaves at least "
                             "one digit unseen")
        self.seen_digits = seen
        self.unseen_digits = [d for d in range(10) if d not in seen]
        perm = np.random.default_rng(int(self.options.get("split_seed", 0))).permutation(
            len(self.labels))
        n_test = round(frac * len(perm))
        train = sorted(perm[n_test:].tolist())
        self.splits = {"test": sorted(perm[:n_test].tolist()),
                       "train": [i for i in train if int(self.labels[i]) in seen],
                       "prompts": list(range(10 * len(EVAL_TEMPLATES)))}

    def sample_ids(self, split: str) -> list[int]:
        if split not in self.splits:
            raise KeyError(f"DigitCaptions has splits {', '.join(self.splits)}; not {split!r}")
        return list(self.splits[split])

    def label(self, split: str, i: int) -> int:
        """The digit of sample ``i`` of ``split``."""
        return int(i) % 10 if split == "prompts" else int(self.labels[int(i)])

    def load(self, modality: str, split: str, ids: Sequence[int]) -> Any:
        ids = [int(i) for i in ids]
        if modality == "image":
            if split == "prompts":
                raise KeyError("the prompts split has text only")
            return self.images[ids]
        if split == "prompts":
            return [prompt(i % 10, i // 10) for i in ids]
        return [caption(int(self.labels[i]), i) for i in ids]

    def eval_inputs(self) -> dict[str, tuple[str, list[int]]]:
        """Evaluation: every held-out image and every prompt."""
        return {"image": ("test", self.sample_ids("test")),
                "text": ("prompts", self.sample_ids("prompts"))}
