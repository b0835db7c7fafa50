"""``EmbeddingCache``: a frozen encoder's embeddings, keyed by what was embedded.

A frozen encoder gives the same embedding for the same input every time. The
encoder role chooses the key of each sample
(:meth:`~dlrover_plugin_multimodal.encoder.EncoderWorkload.cache_keys`): the text
itself for text, so a caption shared by many samples is embedded once; the
``split/id`` of the sample otherwise. After every distinct input has been seen, every
lookup is a hit and the encoder network is not run again.

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
    """Rows of ``[d]`` float32 embeddings by key (a ``str``: a caption, ``split/id``).

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
        self._rows: dict[str, torch.Tensor] = {}
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

    def lookup(self, keys: Sequence[str]) -> tuple[list[torch.Tensor | None], list[int]]:
        """``(rows, missing)``: the cached row of each key (``None`` when absent) and
        the positions in ``keys`` of the absent ones. Counts one hit or miss per
        position."""
        rows: list[torch.Tensor | None] = []
        missing = []
        for pos, k in enumerate(keys):
            row = self._rows.get(k)
            rows.append(row)
            if row is None:
                missing.append(pos)
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        return rows, missing

    def put(self, keys: Sequence[str], embeddings: torch.Tensor) -> None:
        """Store ``embeddings`` (``[len(keys), d]``) row by row (copied, so the cache
        does not pin a larger batch tensor), and write them to the directory if any.

        Raises:
            ValueError: the number of rows differs from ``len(keys)``, or a key is
                not a ``str``.
            OSError: the directory cannot be written.
        """
        if embeddings.shape[0] != len(keys):
            raise ValueError(f"EmbeddingCache.put: {embeddings.shape[0]} rows for "
                             f"{len(keys)} keys")
        keys = list(keys)
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise ValueError(f"EmbeddingCache.put: keys must be str; got {bad[0]!r}")
        for k, row in zip(keys, embeddings):
            self._rows[k] = row.detach().clone()
        if self.directory:
            self._write(keys, embeddings)

    # ------------------------------------------------------------------ files
    def _write(self, keys: list[str], embeddings: torch.Tensor) -> None:
        buf = io.BytesIO()
        torch.save({"keys": keys,
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
                keys, emb = list(part["keys"]), part["embeddings"]
                if emb.shape[0] != len(keys):
                    raise ValueError(f"{emb.shape[0]} rows for {len(keys)} keys")
            except Exception as exc:  # noqa: BLE001 - a bad file costs only re-embedding
                log.warning("embedding cache file %s is unreadable (%s); skipping it",
                            path, exc)
                self.skipped_files += 1
                continue
            for k, row in zip(keys, emb):
                if k not in self._rows:
                    self._rows[k] = row
                    self.loaded += 1


__all__ = ["EmbeddingCache"]
