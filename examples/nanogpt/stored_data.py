"""The training split of the nanoGPT corpus as a slow, stored dataset: the input
pipeline of :mod:`examples.nanogpt.tuned_workload`.

The split is cut into non-overlapping windows of ``block_size + 1`` characters, each
stored zlib-compressed (like records in object-store shards). Reading sample ``i``
waits ``read_latency_s`` (a simulated storage round trip, the dominant cost) and then
decodes on the CPU (decompress, characters to ids). With ``num_workers=0`` the
training process pays every read in turn; loader worker processes overlap them, which
is what the ``dataloader_workers`` tuner finds out.
"""

from __future__ import annotations

import time
import zlib

import torch
from torch.utils.data import Dataset

from examples.nanogpt.data import load_corpus


class StoredCharWindows(Dataset):
    """Sample ``i``: ``(x, y, i)`` with ``x``, ``y`` (block_size,) int64 ids, ``y`` shifted
    by one, and the sample id ``i`` (an int; a batch of them is an int64 tensor).

    Args:
        block_size: characters per sample.
        read_latency_s: seconds each read waits (simulated storage latency, >= 0).
        val_fraction: the tail held out (not in this dataset), as in ``CharDataset``.
    """

    def __init__(self, block_size: int, read_latency_s: float = 0.002,
                 val_fraction: float = 0.1) -> None:
        if read_latency_s < 0:
            raise ValueError(f"read_latency_s={read_latency_s} is invalid; allowed: >= 0")
        text = load_corpus()
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        train = text[:len(text) - int(len(text) * val_fraction)]
        w = block_size + 1
        self.block_size, self.read_latency_s = block_size, read_latency_s
        self.records = [zlib.compress(train[i * w:(i + 1) * w].encode())
                        for i in range(len(train) // w)]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.read_latency_s:
            time.sleep(self.read_latency_s)
        s = zlib.decompress(self.records[i]).decode()
        ids = torch.tensor([self.stoi[c] for c in s], dtype=torch.long)
        return ids[:-1], ids[1:], i
