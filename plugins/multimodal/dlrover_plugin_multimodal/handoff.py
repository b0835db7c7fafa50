"""How one step's encoder outputs reach the trainer ranks, worker to worker.

The driver calls an encoder role non-blocking with a step's sample ids; the role
group splits the ids over the encoder's ``m`` ranks in contiguous, near-equal
chunks (first chunks larger), and the call returns a ``DRef`` of ``m`` results.
The driver wraps the ``DRef`` 's object references, with each chunk's position in
the step, into an :class:`EncodedRefs` and passes it to every trainer rank.
The references are nested in the argument, so Ray does not resolve them on the
way: each trainer rank fetches only the results that overlap its own share of
the step, straight from the producers, and checks the sample ids it got.

Each encoder result is a dict with ``ids`` (``[k]`` int64, the sample ids in order)
and one payload: ``embeddings`` (``[k, d]`` float32, frozen encoders) or ``inputs``
(preprocessed samples, trainable encoders: a tensor/array with dim 0 of ``k``, a
list, or a dict of those). Other keys are ignored.

Where the bytes go: :class:`~dlrover_plugin_multimodal.encoder.EncoderWorkload` puts
the payload into the object store itself and returns ``{"ids", "object": ref}``. So
the encoder owns the payload's object and the driver, which called the encoder,
receives only that record (the ids and a reference, returned inline by Ray because it
is far below Ray's 100 KiB inline limit) and passes it on without deserialising it.
:func:`fetch_rows` gets the records and then the payloads, from the object store of
the encoder's node (``ray.put`` stores there whatever the size; a trainer on another
node gets a copy node to node). The payload is never sent to the driver. A result
that carries its payload inline (a custom encoder's) reaches the trainer through the
driver's process when it is under the 100 KiB limit (see ``dlrover_core.runtime.dref``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dlrover_core.runtime.role_group import chunk_bounds

PAYLOADS = ("embeddings", "inputs")


@dataclass(frozen=True)
class EncodedRefs:
    """One modality's encoder outputs of one step, as references.

    Attributes:
        role, modality: which encoder produced them.
        payload: ``embeddings`` or ``inputs``.
        refs: one Ray ``ObjectRef`` per encoder rank, in rank order.
        bounds: ``[start, stop)`` positions in the step's id list of each ref's rows.
    """

    role: str
    modality: str
    payload: str
    refs: tuple
    bounds: tuple

    @classmethod
    def from_dref(cls, dref: Any, n_ids: int, modality: str, payload: str) -> EncodedRefs:
        """Wrap a ``DRef`` of an encoder call that got ``n_ids`` ids."""
        refs = tuple(dref.refs)
        return cls(dref.role, modality, payload, refs, tuple(chunk_bounds(n_ids, len(refs))))

    def overlapping(self, start: int, stop: int) -> list[int]:
        """Indices of the refs whose rows overlap ``[start, stop)``."""
        return [i for i, (a, b) in enumerate(self.bounds) if a < stop and b > start]


def take_rows(value: Any, a: int, b: int) -> Any:
    """Rows ``[a, b)`` of a payload (tensor, array, list, tuple or dict of those)."""
    if isinstance(value, dict):
        return {k: take_rows(v, a, b) for k, v in value.items()}
    return value[a:b]


def concat_rows(parts: list[Any]) -> Any:
    """Concatenate payload parts along dim 0 (tensors, arrays, lists, dicts of them)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, dict):
        return {k: concat_rows([p[k] for p in parts]) for k in first}
    if isinstance(first, (list, tuple)):
        return [x for p in parts for x in p]
    mod = type(first).__module__
    if mod.startswith("numpy"):
        import numpy as np

        return np.concatenate(parts, axis=0)
    import torch

    return torch.cat(parts, dim=0)


def fetch_rows(enc: EncodedRefs, ids: Sequence[int], start: int, stop: int,
               timeout: float | None = None) -> Any:
    """In a trainer rank: the payload rows of positions ``[start, stop)`` of the step,
    fetched from the encoder ranks that hold them.

    Raises:
        ray.exceptions.RayError: an encoder call failed or its process died.
        ValueError: the results' ``ids`` are not ``ids[start:stop]`` (the encoder
            returned other samples or another order), or a result lacks the payload.
    """
    import ray

    idx = enc.overlapping(start, stop)
    values = ray.get([enc.refs[i] for i in idx], timeout=timeout)
    for v in values:
        if not isinstance(v, dict) or "ids" not in v or (enc.payload not in v
                                                        and "object" not in v):
            raise ValueError(f"{enc.role} (modality {enc.modality!r}) returned "
                             f"{type(v).__name__} without 'ids' and {enc.payload!r} or "
                             "'object'")
    held = [k for k, v in enumerate(values) if enc.payload not in v]
    if held:  # payloads the encoder put into the object store: the second hop
        objects = ray.get([values[k]["object"] for k in held], timeout=timeout)
        values = list(values)
        for k, obj in zip(held, objects):
            values[k] = {**obj, "ids": values[k]["ids"]}
    parts, got = [], []
    for i, v in zip(idx, values):
        a, b = enc.bounds[i]
        if not isinstance(v, dict) or enc.payload not in v:
            raise ValueError(f"{enc.role} (modality {enc.modality!r}) put "
                             f"{type(v).__name__} without {enc.payload!r} into the "
                             "object store")
        lo, hi = max(a, start) - a, min(b, stop) - a
        parts.append(take_rows(v[enc.payload], lo, hi))
        got.extend(int(x) for x in v["ids"][lo:hi])
    want = [int(x) for x in ids[start:stop]]
    if got != want:
        raise ValueError(f"{enc.role} (modality {enc.modality!r}) returned sample ids "
                         f"{got[:8]}... for positions [{start}, {stop}); expected "
                         f"{want[:8]}...")
    return concat_rows(parts)


__all__ = ["PAYLOADS", "EncodedRefs", "chunk_bounds", "concat_rows", "fetch_rows", "take_rows"]
