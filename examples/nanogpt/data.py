"""The Python reference manual as a character corpus.

``pydoc_data.topics.topics`` ships with every CPython: about 465,000 characters,
103 distinct symbols. The topics are joined in sorted-key order; the last 10% is
held out for validation.
"""

from __future__ import annotations

import functools
import zlib

import torch


def load_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


@functools.lru_cache(maxsize=2)
def _encoded(val_fraction: float) -> tuple[tuple[str, ...], torch.Tensor, torch.Tensor]:
    """``(symbols, train ids, validation ids)``, ids int64; made once per process for
    each ``val_fraction`` (0.05-0.07 s here), then shared by every :class:`CharDataset`."""
    text = load_corpus()
    chars = tuple(sorted(set(text)))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n_val = int(len(data) * val_fraction)
    return chars, data[:-n_val], data[-n_val:]


class CharDataset:
    """Encoded train/validation splits and deterministic batch sampling.

    Batches are a function of ``(seed, rank, step)`` only, so a resumed run sees
    the same data stream as an uninterrupted one. The corpus is encoded once per
    process: a standby's ``warm_up()`` makes the first one, so that a promoted spare's
    ``setup()`` (and a survivor's re-setup) does not encode it again; the split
    tensors are shared and only read.
    """

    def __init__(self, val_fraction: float = 0.1) -> None:
        chars, self.train, self.val = _encoded(float(val_fraction))
        self.chars = list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, split: str, batch_size: int, block_size: int, seed: int, rank: int,
              step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``, ``y``: (batch_size, block_size) int64; ``y`` is ``x`` shifted by one."""
        data = self.train if split == "train" else self.val
        ix = self.sample_ids(split, batch_size, block_size, seed, rank, step)
        x = torch.stack([data[i:i + block_size] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
        return x, y

    def sample_ids(self, split: str, batch_size: int, block_size: int, seed: int, rank: int,
                   step: int) -> torch.Tensor:
        """The ids of :meth:`batch`'s samples: each window's start offset in ``split``
        (int64, ``batch_size`` of them), a function of ``(seed, rank, step)`` only."""
        n = len(self.train if split == "train" else self.val)
        # zlib.crc32, not hash(): str hashes differ between processes (PYTHONHASHSEED)
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{rank}/{step}/{split}".encode()))
        return torch.randint(n - block_size - 1, (batch_size,), generator=g)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)
