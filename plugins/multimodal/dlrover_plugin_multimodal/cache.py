"""``EmbeddingCache``: a frozen encoder's embeddings, keyed by ``(split, sample id)``.

A frozen encoder gives the same embedding for a sample every time, so after the
first epoch every lookup is a hit and the encoder network is not run again. The
cache lives in the encoder's process (it is lost when that process is replaced).
"""

from __future__ import annotations

from typing import Sequence

import torch


class EmbeddingCache:
    """Rows of ``[d]`` float32 embeddings by ``(split, sample id)``.

    Attributes:
        hits, misses: lookups answered from the cache / not, since creation.
    """

    def __init__(self) -> None:
        self._rows: dict[tuple[str, int], torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, split: str, ids: Sequence[int]) -> tuple[list[torch.Tensor | None],
                                                             list[int]]:
        """``(rows, missing)``: the cached row of each id (``None`` when absent) and
        the positions in ``ids`` of the absent ones. Counts hits and misses."""
        rows: list[torch.Tensor | None] = []
        missing = []
        for pos, i in enumerate(ids):
            row = self._rows.get((split, int(i)))
            rows.append(row)
            if row is None:
                missing.append(pos)
        self.misses += len(missing)
        self.hits += len(ids) - len(missing)
        return rows, missing

    def put(self, split: str, ids: Sequence[int], embeddings: torch.Tensor) -> None:
        """Store ``embeddings`` (``[len(ids), d]``) row by row (copied, so the cache does
        not pin a larger batch tensor).

        Raises:
            ValueError: the number of rows differs from ``len(ids)``.
        """
        if embeddings.shape[0] != len(ids):
            raise ValueError(f"EmbeddingCache.put: {embeddings.shape[0]} rows for "
                             f"{len(ids)} ids")
        for i, row in zip(ids, embeddings):
            self._rows[(split, int(i))] = row.detach().clone()


__all__ = ["EmbeddingCache"]
