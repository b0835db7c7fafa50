"""``EncoderWorkload``: the base class of a modality's encoder role.

You provide, in a subclass:

- :meth:`EncoderWorkload.build_encoder` (a classmethod): the encoder network. A
  frozen encoder builds it in its own process (load pretrained weights here); a
  trainable one is built by the trainer into its model, from the same method.
- :meth:`EncoderWorkload.preprocess` (optional): raw samples from the dataset ->
  the network's input (tokenise, scale pixels). It runs in the encoder role.
- :meth:`EncoderWorkload.forward` (optional): run the network on preprocessed
  inputs (default ``module(inputs)``); frozen encoders only.
- :meth:`EncoderWorkload.cache_keys` (optional): what the embedding cache is keyed
  by (default: the text itself for text samples, ``split/id`` otherwise).

The driver calls ``embed`` (frozen) or ``inputs`` (trainable) with a step's
``(split, ids)``; the role group splits the ids over the role's ranks.

Each call puts its payload (the embeddings or the preprocessed inputs) into Ray's
object store itself (``ray.put`` in this process, so this encoder owns the object)
and returns only the sample ids and that object's reference. That small record is
what Ray returns to the driver; the payload's bytes stay in the object store of this
encoder's node until a trainer rank fetches them (see
:mod:`dlrover_plugin_multimodal.handoff`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from dlrover_core import BaseWorkload
from dlrover_plugin_multimodal.cache import EmbeddingCache
from dlrover_plugin_multimodal.config import MultimodalConfig
from dlrover_plugin_multimodal.dataset import MultimodalDataset, load_dataset


class MultimodalWorkload(BaseWorkload):
    """What every role of a ``multimodal`` job shares: :attr:`mm` (the validated
    ``config.multimodal``), :attr:`dataset`, and :meth:`init_torch`."""

    _mm: MultimodalConfig | None = None
    _dataset: MultimodalDataset | None = None

    @property
    def mm(self) -> MultimodalConfig:
        if self._mm is None:
            self._mm = MultimodalConfig.from_config(self.config)
        return self._mm

    @property
    def dataset(self) -> MultimodalDataset:
        """The job's dataset, built in this process on first use."""
        if self._dataset is None:
            mm = self.mm
            self._dataset = load_dataset(mm.dataset, mm.modalities, mm.data_options)
        return self._dataset

    def init_torch(self, offset: int = 0) -> int:
        """Intra-op threads from ``config.torch_threads`` (default 1: roles share few
        cores) and a torch seed ``config.multimodal.seed + offset + 17 * rank``.
        Returns the seed."""
        torch.set_num_threads(int(self.config.get("torch_threads", 1)))
        seed = self.mm.seed + offset + 17 * self.rank
        torch.manual_seed(seed)
        return seed


class EncoderWorkload(MultimodalWorkload):
    """One modality's encoder role (see the module docstring).

    Attributes (after ``setup``):
        encoder: the role's :class:`~dlrover_plugin_multimodal.config.EncoderConfig`
            (``modality``, ``trainable``, ``cache``).
        module: the frozen network (``None`` for a trainable encoder, whose network
            lives in the trainer).
        cache: the :class:`EmbeddingCache` (``None`` when off).
    """

    module: torch.nn.Module | None = None
    cache: EmbeddingCache | None = None

    # ------------------------------------------------------------------ override
    @classmethod
    def build_encoder(cls, config: Any) -> torch.nn.Module:
        """The encoder network. ``config``: the job config (``DictConfig``). Called in
        this role's process for a frozen encoder and in the trainer for a trainable
        one. Override."""
        raise NotImplementedError(f"{cls.__name__}.build_encoder(config)")

    def preprocess(self, raw: Any) -> Any:
        """Raw samples (what the dataset's ``load`` returns, ``n`` of them) -> the
        network's input, ``n`` rows. Default: unchanged."""
        return raw

    def forward(self, inputs: Any) -> torch.Tensor:
        """Frozen encoders: ``[n, d]`` float embeddings of preprocessed inputs.
        Default: ``self.module(inputs)``."""
        assert self.module is not None
        return self.module(inputs)

    def cache_keys(self, split: str, ids: Sequence[int], raw: Any) -> list[str]:
        """The embedding cache's key of each sample (``raw``: what the dataset's
        ``load`` returned for ``ids``). Samples with equal keys must have equal
        embeddings. Default: for a list of ``str`` (text), the text itself, so the
        same caption of many samples runs through the network once; otherwise
        ``"<split>/<id>"``."""
        if isinstance(raw, (list, tuple)) and all(isinstance(t, str) for t in raw):
            return [f"text:{t}" for t in raw]
        return [f"id:{split}/{int(i)}" for i in ids]

    # ------------------------------------------------------------------ lifecycle
    def setup(self) -> None:
        self.init_torch(offset=1000)
        self.encoder = self.mm.encoders[self.role]
        self.embedded = 0  # samples run through the network in this process (frozen)
        self.loaded = 0  # samples loaded and preprocessed for the trainer (trainable)
        _ = self.dataset
        if self.encoder.trainable:
            return
        self.module = self.build_encoder(self.config)
        self.module.eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.cache = None
        if self.encoder.cache:
            directory = None
            if self.encoder.persist_cache and self.job_dir:
                directory = self.cache_dir()
            self.cache = EmbeddingCache(
                directory, f"rank{self.rank}-a{self.attempt}-pid{os.getpid()}")

    def cache_dir(self) -> str:
        """``<job dir>/embedding_cache/<run id>/<role>``: shared by the role's ranks and
        their replacements in this run of the job; rank 0 removes other runs' caches."""
        root = os.path.join(self.job_dir, "embedding_cache")
        run = self.context.run_id or "run"
        if self.rank == 0 and self.attempt == 0 and os.path.isdir(root):
            for old in os.listdir(root):
                if old != run:
                    shutil.rmtree(os.path.join(root, old), ignore_errors=True)
        return os.path.join(root, run, self.role)

    def failover_policy(self) -> str:
        """``roles.<role>.config.failover`` of this encoder role: ``replace`` (the
        ``multimodal`` template's default: a failed rank is replaced while the driver keeps
        running and retries the step's calls on it) or ``rollback`` (the driver restarts
        and puts the trainer back to its last commit). Asked by the driver once, at start.

        Raises:
            SpecError: another value.
        """
        from dlrover_core.graph.graph import check_failover_policy

        return check_failover_policy(self.role, self.config.get("failover"))

    # ------------------------------------------------------------------ driver calls
    def embed(self, split: str, ids: Sequence[int]) -> dict[str, Any]:
        """Frozen encoders: ``{"ids": [n] int64, "object": ref}``, ``ref`` holding
        ``{"embeddings": [n, d] float32}`` of the ``ids`` of ``split``, in order
        (see :meth:`hand_off`), computed under ``torch.inference_mode``; with the
        cache, only samples whose key (:meth:`cache_keys`) is not in it are run
        through the network, each distinct key once.

        Raises:
            RuntimeError: the encoder is trainable (call ``inputs``).
        """
        if self.encoder.trainable:
            raise RuntimeError(f"{self.role} is trainable: its network runs in the trainer; "
                               "the driver calls inputs(), not embed()")
        ids = [int(i) for i in ids]
        raw = self.dataset.load(self.encoder.modality, split, ids)
        with torch.inference_mode():
            if self.cache is None:
                emb = self._run(raw, len(ids))
            else:
                keys = self.cache_keys(split, ids, raw)
                rows, missing = self.cache.lookup(keys)
                if missing:
                    first: dict[str, int] = {}  # each distinct missing key, run once
                    for p in missing:
                        first.setdefault(keys[p], p)
                    new = self._run(_pick(raw, list(first.values())), len(first))
                    self.cache.put(list(first), new)
                    by_key = dict(zip(first, new))
                    for p in missing:
                        rows[p] = by_key[keys[p]]
                emb = torch.stack(rows) if rows else torch.zeros(0)
        return self.hand_off(ids, "embeddings", emb.detach().float().contiguous())

    def inputs(self, split: str, ids: Sequence[int]) -> dict[str, Any]:
        """Trainable encoders: ``{"ids": [n] int64, "object": ref}``, ``ref`` holding
        the preprocessed samples for the trainer's copy of the network (see
        :meth:`hand_off`)."""
        ids = [int(i) for i in ids]
        raw = self.dataset.load(self.encoder.modality, split, ids)
        out = self.hand_off(ids, "inputs", self.preprocess(raw))
        self.loaded += len(ids)
        return out

    def hand_off(self, ids: list[int], payload: str, value: Any) -> dict[str, Any]:
        """The record an encoder call returns: ``{"ids": [n] int64, "object": ref}``,
        ``ref`` an object this process put into Ray's object store (so this encoder
        owns it) holding ``{payload: value}``; the caller (the driver) gets only the
        record. Outside Ray (no ``ray.init``), ``{"ids", payload: value}`` inline."""
        import ray

        out: dict[str, Any] = {"ids": torch.tensor(ids, dtype=torch.int64)}
        if ray.is_initialized():
            out["object"] = ray.put({payload: value})
        else:
            out[payload] = value
        return out

    def stats(self) -> dict[str, float]:
        """Counters since this process started: trainable encoders ``loaded`` (samples
        handed to the trainer); frozen ones ``embedded`` (samples run through the
        network) and, with the cache, ``cache_hits``, ``cache_misses``, ``cache_size`` and
        ``cache_loaded`` (rows reloaded from the job's cache directory at start)."""
        if self.encoder.trainable:
            return {"loaded": float(self.loaded)}
        out = {"embedded": float(self.embedded)}
        if self.cache is not None:
            out.update(cache_hits=float(self.cache.hits), cache_misses=float(self.cache.misses),
                       cache_size=float(len(self.cache)), cache_loaded=float(self.cache.loaded))
        return out

    # ------------------------------------------------------------------ internals
    def _run(self, raw: Any, n: int) -> torch.Tensor:
        out = self.forward(self.preprocess(raw))
        if out.shape[0] != n:
            raise ValueError(f"{type(self).__name__}.forward returned {out.shape[0]} rows "
                             f"for {n} samples")
        self.embedded += n
        return out


def _pick(raw: Any, positions: list[int]) -> Any:
    """Rows ``positions`` of raw samples (a list, a tensor or an array)."""
    if isinstance(raw, (list, tuple)):
        return [raw[p] for p in positions]
    return raw[positions]


__all__ = ["EncoderWorkload", "MultimodalWorkload"]
