"""``EmbeddingCache``: a frozen encoder's embeddings, keyed by ``(split, sample id)``.

A frozen encoder gives the same embedding for a sample every time, so after the
first epoch every lookup is a hit and the encoder network is not run again.

With a ``directory``, every batch of new rows is also written there as one file,
atomically (temp file, fsync, rename) with a sha256 of its bytes in the first line;
a new cache on the same directory (a replaced encoder process, another rank of the
role) loads every file whose checksum matches and skips, with a warning, any that
does not. So a frozen encoder embeds each sample once per job, across restarts.
"""

from __future__ import annotations

import glob
import hashlib
import io
import logging
import os
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


class EmbeddingCache:
    """Rows of ``[d]`` float32 embeddings by ``(split, sample id)``.

    Args:
        directory: where to persist and reload rows (``None``: memory only).
        writer: a name unique to this writer among those sharing ``directory``
            (``rank0-a1``: rank and attempt), used in its file names.

    Attributes:
        hits, misses: lookups answered from the cache / not, since creation.
        loaded: rows reloaded from ``directory`` when the cache was created.
        skipped_files: files in ``directory`` whose checksum did not match.
    """

    def __init__(self, directory: str | None = None, writer: str = "w") -> None:
        self._rows: dict[tuple[str, int], torch.Tensor] = {}
        self.hits = 0
        self.misses = 0
        self.loaded = 0
        self.skipped_files = 0
        self.directory = directory
        self.writer = writer
        self._seq = 0
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._reload()

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
        not pin a larger batch tensor), and write them to the directory if any.

        Raises:
            ValueError: the number of rows differs from ``len(ids)``.
            OSError: the directory cannot be written.
        """
        if embeddings.shape[0] != len(ids):
            raise ValueError(f"EmbeddingCache.put: {embeddings.shape[0]} rows for "
                             f"{len(ids)} ids")
        ids = [int(i) for i in ids]
        for i, row in zip(ids, embeddings):
            self._rows[(split, i)] = row.detach().clone()
        if self.directory:
            self._write(split, ids, embeddings)

    # ------------------------------------------------------------------ files
    def _write(self, split: str, ids: list[int], embeddings: torch.Tensor) -> None:
        buf = io.BytesIO()
        torch.save({"split": split, "ids": torch.tensor(ids, dtype=torch.int64),
                    "embeddings": embeddings.detach().to("cpu", torch.float32).clone()}, buf)
        payload = buf.getvalue()
        name = f"{self.writer}-{self._seq:06d}.pt"
        self._seq += 1
        path = os.path.join(self.directory, name)
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _reload(self) -> None:
        for path in sorted(glob.glob(os.path.join(self.directory, "*.pt"))):
            try:
                with open(path, "rb") as f:
                    digest, _, payload = f.read().partition(b"\n")
                if hashlib.sha256(payload).hexdigest().encode() != digest:
                    raise ValueError("sha256 mismatch")
                part = torch.load(io.BytesIO(payload), weights_only=True)
                split, ids, emb = part["split"], part["ids"], part["embeddings"]
                if emb.shape[0] != ids.numel():
                    raise ValueError(f"{emb.shape[0]} rows for {ids.numel()} ids")
            except Exception as exc:  # noqa: BLE001 - a bad file costs only re-embedding
                log.warning("embedding cache file %s is unreadable (%s); skipping it",
                            path, exc)
                self.skipped_files += 1
                continue
            for i, row in zip(ids.tolist(), emb):
                if (split, i) not in self._rows:
                    self._rows[(split, i)] = row
                    self.loaded += 1


__all__ = ["EmbeddingCache"]
