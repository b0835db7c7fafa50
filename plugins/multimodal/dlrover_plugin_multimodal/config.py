"""The ``config.multimodal`` section of a ``multimodal`` job: data, encoders and loop.

Pure Python (no torch), so the template's ``apply`` validates a spec in the client
before anything starts. The driver and every workload read the same section with
:meth:`MultimodalConfig.from_config`.

Example (YAML)::

    config:
      multimodal:
        data:
          dataset: examples.multimodal_clip_digits.data:DigitCaptions
          modalities: [image, text]
          options: {test_fraction: 0.2}
        encoders:
          vision_encoder: {modality: image, trainable: true}
          text_encoder: {modality: text, cache: true}
        batch_size: 128
        epochs: 8
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.fields import check_fields, read_fields, refuse_unknown, spec_field
from dlrover_core.spec.values import plain, typed_value

KEY = "config.multimodal"
TRAINER = "trainer"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


@dataclass(frozen=True)
class EncoderConfig:
    """One encoder role.

    Attributes:
        role: the role's name in ``roles``.
        modality: the data modality it embeds (a name in ``data.modalities``).
        trainable: ``False`` (frozen): the role runs the encoder under
            ``torch.inference_mode`` and hands embeddings to the trainer.
            ``True``: the encoder network is part of the trainer's model (built there
            from the role's ``build_encoder``); the role loads and preprocesses its
            modality's samples and must share bundles with the trainer.
        cache: frozen encoders only: keep each embedding, keyed by the encoder's
            ``cache_keys`` (the text itself for text, ``split/id`` otherwise), so each
            distinct input is embedded once.
        persist_cache: with ``cache``, also write the embeddings under
            ``<job dir>/embedding_cache/<run id>/<role>/`` (atomic, checksummed
            files), so a replaced encoder process or another rank of the role reloads
            them: each sample is embedded once per job.
        workload: import path of the role's workload class (filled in from
            ``roles.<role>.workload`` by the template; the trainer builds trainable
            encoders from it).
    """

    role: str
    modality: str
    trainable: bool = False
    cache: bool = True
    persist_cache: bool = True
    workload: str = ""


@dataclass(frozen=True)
class MultimodalConfig:
    """Settings of a ``multimodal`` job.

    Data:
        dataset: import path ``package.module:Class`` of a
            :class:`~dlrover_plugin_multimodal.dataset.MultimodalDataset`.
        modalities: the modalities of the data; each needs exactly one encoder role.
        data_options: handed to the dataset's constructor (``data.options``).

    Loop (read by the driver):
        batch_size: samples per step (global), split in order over the trainer ranks;
            a multiple of ``roles.trainer.total``.
        epochs: passes over the ``train`` split (each epoch a fresh permutation
            seeded by ``seed`` and the epoch). ``max_steps``: stop after this many
            steps instead (0: ``epochs`` decides). ``evaluate``: call the trainer's
            ``evaluate`` before the first step and after the last, reporting
            ``<metric>_untrained`` and ``<metric>``. ``prefetch``: steps of encoder
            work issued ahead of the trainer (0: none, encoders and trainer
            alternate). ``fetch_timeout_s``: how long a trainer rank waits for an
            encoder's output of one step.
    """

    dataset: str
    modalities: tuple[str, ...]
    encoders: dict[str, EncoderConfig]
    data_options: dict[str, Any] = field(default_factory=dict)
    batch_size: int = spec_field(64, ge=1)
    epochs: int = spec_field(1, ge=1)
    max_steps: int = spec_field(0, ge=0, note="0: epochs decide")
    evaluate: bool = True
    prefetch: int = spec_field(1, ge=0)
    seed: int = 0
    fetch_timeout_s: float = spec_field(300.0, gt=0, unit="seconds")

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_config(cls, config: Any, key: str = KEY) -> MultimodalConfig:
        """Read and validate ``config.multimodal`` (``config`` is the job config, a
        dict or ``DictConfig``).

        Raises:
            SpecError: a missing or unknown key, a value of the wrong type or out of
                range; the message names ``config.multimodal.<key>``, the value and
                what is allowed.
        """
        section = plain(config.get("multimodal") if config is not None else None)
        if section is None:
            raise SpecError(key, None, "a mapping with data and encoders "
                            "(see MultimodalConfig)", "missing")
        if not isinstance(section, Mapping):
            raise SpecError(key, section, "a mapping with data and encoders")
        loop = {f.name: f for f in dataclasses.fields(cls)
                if f.name not in ("dataset", "modalities", "encoders", "data_options")}
        refuse_unknown(section, ("data", "encoders", *loop), key, "unknown multimodal setting")
        dataset, modalities, options = _data(section.get("data"), f"{key}.data")
        encoders = _encoders(section.get("encoders"), f"{key}.encoders")
        out = cls(dataset, modalities, encoders, options, **read_fields(cls, section, key, loop))
        out.check(key)
        return out

    def check(self, key: str = KEY) -> None:
        """The fields' declared ranges and the modality <-> encoder match. Raises
        :class:`SpecError`."""
        check_fields(self, MultimodalConfig, key)
        by_modality: dict[str, list[str]] = {}
        for role, enc in self.encoders.items():
            by_modality.setdefault(enc.modality, []).append(role)
        have = ", ".join(f"{m} ({', '.join(r)})" for m, r in sorted(by_modality.items()))
        for i, m in enumerate(self.modalities):
            roles = by_modality.get(m, [])
            if not roles:
                raise SpecError(f"{key}.data.modalities[{i}]", m,
                                f"a modality with an encoder role; encoders: {have or 'none'}",
                                f"no encoder role embeds modality {m!r}: add "
                                f"{key}.encoders.<role>: {{modality: {m}}} and the role")
            if len(roles) > 1:
                raise SpecError(f"{key}.encoders", sorted(roles),
                                "one encoder role per modality",
                                f"roles {', '.join(roles)} all embed modality {m!r}")
        for role, enc in self.encoders.items():
            if enc.modality not in self.modalities:
                raise SpecError(f"{key}.encoders.{role}.modality", enc.modality,
                                "a modality of the data: " + ", ".join(self.modalities))
            if enc.trainable and enc.cache:
                raise SpecError(f"{key}.encoders.{role}.cache", True,
                                "false for a trainable encoder")

    # ------------------------------------------------------------------ views
    def encoder_of(self, modality: str) -> EncoderConfig:
        """The encoder of ``modality``. Raises ``KeyError``."""
        for enc in self.encoders.values():
            if enc.modality == modality:
                return enc
        raise KeyError(f"no encoder role for modality {modality!r}")

    @property
    def trainable(self) -> list[EncoderConfig]:
        return [e for e in self.encoders.values() if e.trainable]

    @property
    def frozen(self) -> list[EncoderConfig]:
        return [e for e in self.encoders.values() if not e.trainable]

    def as_dict(self) -> dict[str, Any]:
        """The section as written back into the spec (``config.multimodal``)."""
        out: dict[str, Any] = {
            "data": {"dataset": self.dataset, "modalities": list(self.modalities),
                     "options": dict(self.data_options)},
            "encoders": {r: {"modality": e.modality, "trainable": e.trainable,
                             "cache": e.cache, "persist_cache": e.persist_cache,
                             "workload": e.workload}
                         for r, e in self.encoders.items()},
        }
        for f in dataclasses.fields(self):
            if f.name not in ("dataset", "modalities", "encoders", "data_options"):
                out[f.name] = getattr(self, f.name)
        return out

    def with_workloads(self, workloads: Mapping[str, str]) -> MultimodalConfig:
        """A copy whose encoders carry their roles' workload import paths."""
        enc = {r: dataclasses.replace(e, workload=workloads.get(r, e.workload))
               for r, e in self.encoders.items()}
        return dataclasses.replace(self, encoders=enc)


def _data(section: Any, key: str) -> tuple[str, tuple[str, ...], dict]:
    if not isinstance(section, Mapping):
        raise SpecError(key, section, "a mapping {dataset: pkg.mod:Class, modalities: [...], "
                        "options: {...}}", "missing" if section is None else "")
    for k in section:
        if k not in ("dataset", "modalities", "options"):
            raise SpecError(f"{key}.{k}", section[k], "one of: dataset, modalities, options",
                            "unknown data setting")
    dataset = section.get("dataset")
    if not isinstance(dataset, str) or not _IMPORT_PATH.match(dataset):
        raise SpecError(f"{key}.dataset", dataset, "an import path 'package.module:Class' of "
                        "a MultimodalDataset")
    modalities = section.get("modalities")
    if not isinstance(modalities, (list, tuple)) or not modalities:
        raise SpecError(f"{key}.modalities", modalities,
                        "a non-empty list of modality names, e.g. [image, text]")
    for i, m in enumerate(modalities):
        if not isinstance(m, str) or not _NAME.match(m):
            raise SpecError(f"{key}.modalities[{i}]", m,
                            "a name of lower-case letters, digits and '_'")
    if len(set(modalities)) != len(modalities):
        raise SpecError(f"{key}.modalities", list(modalities), "distinct modality names")
    options = section.get("options") or {}
    if not isinstance(options, Mapping):
        raise SpecError(f"{key}.options", options, "a mapping handed to the dataset")
    return dataset, tuple(modalities), dict(options)


_ENCODER_KEYS = ("modality", "trainable", "cache", "persist_cache", "workload")


def _encoders(section: Any, key: str) -> dict[str, EncoderConfig]:
    if not isinstance(section, Mapping) or not section:
        raise SpecError(key, section, "a mapping role -> {modality: m, trainable: false, "
                        "cache: true}, one role per modality",
                        "missing" if section is None else "")
    out = {}
    for role, enc in section.items():
        k = f"{key}.{role}"
        if not isinstance(role, str) or not _NAME.match(role):
            raise SpecError(key, role, "role names of lower-case letters, digits and '_'")
        if role == TRAINER:
            raise SpecError(k, enc, "an encoder role other than 'trainer'",
                            "'trainer' is the fusion role, not an encoder")
        if isinstance(enc, str):  # shorthand: role: modality
            enc = {"modality": enc}
        if not isinstance(enc, Mapping):
            raise SpecError(k, enc, "a mapping {modality: m, trainable: false, cache: true}")
        for name in enc:
            if name not in _ENCODER_KEYS:
                raise SpecError(f"{k}.{name}", enc[name], "one of: " + ", ".join(_ENCODER_KEYS),
                                "unknown encoder setting")
        modality = enc.get("modality")
        if not isinstance(modality, str) or not _NAME.match(modality):
            raise SpecError(f"{k}.modality", modality, "a modality name of the data")
        trainable = typed_value(f"{k}.trainable", enc.get("trainable", False), bool)
        cache_given = "cache" in enc
        cache = typed_value(f"{k}.cache", enc.get("cache", not trainable), bool)
        if trainable and cache:
            raise SpecError(f"{k}.cache", enc.get("cache") if cache_given else True,
                            "false for a trainable encoder",
                            "its embeddings change with every update; only frozen "
                            "encoders cache")
        persist = typed_value(f"{k}.persist_cache", enc.get("persist_cache", True), bool)
        workload = enc.get("workload", "") or ""
        if not isinstance(workload, str):
            raise SpecError(f"{k}.workload", workload, "an import path (filled in by the "
                            "template from roles.<role>.workload)")
        out[role] = EncoderConfig(role, modality, trainable, cache, persist and cache, workload)
    return out


__all__ = ["KEY", "TRAINER", "EncoderConfig", "MultimodalConfig"]
