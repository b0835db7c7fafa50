"""``MultimodalDataset``: samples with several modalities, addressed by sample id.

Every process of a ``multimodal`` job builds the same dataset from
``config.multimodal.data`` (:func:`load_dataset`): the driver only asks for sample
ids, each encoder role loads its own modality's samples, and the trainer may use
it for evaluation labels. Only ids travel between processes; the samples are read
where they are encoded.

Example::

    class Pairs(MultimodalDataset):
        modalities = ("image", "text")

        def __init__(self, options):
            self.images, self.captions = ..., ...

        def sample_ids(self, split):
            return list(range(len(self.images))) if split == "train" else []

        def load(self, modality, split, ids):
            if modality == "image":
                return self.images[ids]               # [n, ...] tensor or array
            return [self.captions[i] for i in ids]    # list of n strings
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dlrover_core.plugins.records import resolve


class MultimodalDataset:
    """Base class of a ``multimodal`` job's data. Subclass it and name the subclass in
    ``config.multimodal.data.dataset``.

    Attributes:
        modalities: the modalities the dataset can load (checked against
            ``config.multimodal.data.modalities`` when the driver starts).
    """

    modalities: tuple[str, ...] = ()

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = dict(options)

    def sample_ids(self, split: str) -> list[int]:
        """The ids of a split (``train`` is what the driver iterates over). Override."""
        raise NotImplementedError(f"{type(self).__name__}.sample_ids(split)")

    def load(self, modality: str, split: str, ids: Sequence[int]) -> Any:
        """The raw samples of ``modality`` for ``ids`` of ``split``, in the order of
        ``ids``: a tensor/array whose dim 0 is ``len(ids)``, or a list. Override."""
        raise NotImplementedError(f"{type(self).__name__}.load(modality, split, ids)")

    def eval_inputs(self) -> dict[str, tuple[str, list[int]]]:
        """What the trainer's ``evaluate`` gets: ``{modality: (split, ids)}``; each is
        encoded by that modality's encoder role (zero-shot prompts, held-out images).
        Default: nothing (no evaluation)."""
        return {}


def load_dataset(path: str, modalities: Sequence[str],
                 options: Mapping[str, Any]) -> MultimodalDataset:
    """Import and build the dataset ``path`` with ``options``.

    Raises:
        TypeError: the class is not a :class:`MultimodalDataset`.
        ValueError: it cannot load a modality of ``modalities`` (when it declares
            its ``modalities``).
    """
    cls = resolve(path)
    if not (isinstance(cls, type) and issubclass(cls, MultimodalDataset)):
        raise TypeError(f"config.multimodal.data.dataset={path!r} is not a subclass of "
                        "dlrover_plugin_multimodal.dataset.MultimodalDataset")
    ds = cls(options)
    if ds.modalities:
        missing = [m for m in modalities if m not in ds.modalities]
        if missing:
            raise ValueError(
                f"config.multimodal.data.modalities names {', '.join(missing)}, which "
                f"{path} cannot load; it has: {', '.join(ds.modalities)}")
    return ds


__all__ = ["MultimodalDataset", "load_dataset"]
