"""The versioned ``TuningConfig``: what the master tells every rank to run with.

Its JSON form follows the config file of the dynamic-optimization design (seed
``001_*``), extended with gradient accumulation and the parallelism switches::

    {"version": 3,
     "dataloader": {"batch_size": 16, "num_workers": 4, "pin_memory": false},
     "optimizer": {"learning_rate": 0.003, "grad_accum_steps": 2},
     "parallelism": {"reshard_after_forward": true, "activation_checkpointing": false}}

``dataloader.batch_size`` is the micro-batch of one rank (samples per forward pass);
the global batch of one optimizer step is ``batch_size * grad_accum_steps * world_size``.
Versions only grow: a revert publishes the earlier settings under a new version.
This module imports nothing heavy (it runs in the client, the master and workers).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

SECTIONS = ("dataloader", "optimizer", "parallelism")


@dataclass(frozen=True)
class DataloaderSettings:
    """``batch_size``: samples per micro-batch per rank (>= 1); ``num_workers``: loader
    processes (0 = load in the training process); ``pin_memory``: page-locked host
    buffers (only useful with a GPU)."""

    batch_size: int = 32
    num_workers: int = 0
    pin_memory: bool = False


@dataclass(frozen=True)
class OptimizerSettings:
    """``learning_rate``: the peak learning rate for the current global batch (the
    workload's schedule multiplies it); ``grad_accum_steps``: micro-batches per optimizer
    step (>= 1)."""

    learning_rate: float = 1e-3
    grad_accum_steps: int = 1


@dataclass(frozen=True)
class ParallelismSettings:
    """FSDP2 switches applied at a step boundary (``None``: leave as built).

    ``reshard_after_forward``: free the unsharded parameters after forward (saves memory,
    costs an all-gather in backward); ``activation_checkpointing``: recompute the
    activations of the registered blocks in backward instead of keeping them."""

    reshard_after_forward: bool | None = None
    activation_checkpointing: bool | None = None


_SECTION_TYPES = {"dataloader": DataloaderSettings, "optimizer": OptimizerSettings,
                  "parallelism": ParallelismSettings}


class TuningConfigError(ValueError):
    """A ``TuningConfig`` (or a proposal) has an unknown key or a bad value."""


@dataclass(frozen=True)
class TuningConfig:
    """One version of the tunable settings. Immutable; :meth:`updated` returns a copy.

    Attributes:
        version: 0 for the settings the job was submitted with, +1 per published change.
        dataloader, optimizer, parallelism: the three sections (see their classes).
    """

    version: int = 0
    dataloader: DataloaderSettings = field(default_factory=DataloaderSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    parallelism: ParallelismSettings = field(default_factory=ParallelismSettings)

    def __post_init__(self) -> None:
        _check(self)

    # ------------------------------------------------------------------ views
    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step over ``world_size`` data-parallel ranks."""
        return self.dataloader.batch_size * self.optimizer.grad_accum_steps * world_size

    def to_dict(self) -> dict:
        """Plain JSON-able dict (the wire and persisted form)."""
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def settings(self) -> dict:
        """The three sections without ``version`` (compare two configs' content)."""
        d = self.to_dict()
        d.pop("version")
        return d

    def same_settings(self, other: TuningConfig) -> bool:
        return self.settings() == other.settings()

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, data: dict) -> TuningConfig:
        """Build from the dict form; missing keys take defaults.

        Raises:
            TuningConfigError: an unknown section or key, or a bad value (the message
                names the dotted key, the value and what is allowed).
        """
        if not isinstance(data, dict):
            raise TuningConfigError(f"a TuningConfig must be a mapping, got {type(data).__name__}")
        unknown = set(data) - {"version", *SECTIONS}
        if unknown:
            raise TuningConfigError(
                f"{sorted(unknown)[0]}: unknown TuningConfig section; allowed: version, "
                + ", ".join(SECTIONS))
        kwargs: dict[str, Any] = {"version": _int("version", data.get("version", 0))}
        for name in SECTIONS:
            kwargs[name] = _section(name, data.get(name) or {})
        return cls(**kwargs)

    def updated(self, changes: dict, version: int | None = None) -> TuningConfig:
        """A copy with ``changes`` (``{"dataloader": {"num_workers": 4}}``) applied and
        ``version`` set (default: unchanged).

        Raises:
            TuningConfigError: as :meth:`from_dict`.
        """
        base = self.to_dict()
        for sec, values in (changes or {}).items():
            if sec == "version":
                continue
            if sec not in SECTIONS:
                raise TuningConfigError(
                    f"{sec}: unknown TuningConfig section; allowed: " + ", ".join(SECTIONS))
            if not isinstance(values, dict):
                raise TuningConfigError(f"{sec}: {values!r} is invalid; allowed: a mapping")
            base[sec] = {**base[sec], **values}
        if version is not None:
            base["version"] = version
        return TuningConfig.from_dict(base)

    def diff(self, other: TuningConfig) -> dict:
        """``{section: {key: [self_value, other_value]}}`` for every setting that differs."""
        a, b = self.to_dict(), other.to_dict()
        out: dict = {}
        for sec in SECTIONS:
            for k in a[sec]:
                if a[sec][k] != b[sec][k]:
                    out.setdefault(sec, {})[k] = [a[sec][k], b[sec][k]]
        return out

    def with_version(self, version: int) -> TuningConfig:
        return replace(self, version=version)

    def copy(self) -> TuningConfig:
        return copy.deepcopy(self)


def _int(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TuningConfigError(f"{key}: {v!r} is invalid; allowed: an integer")
    return v


def _section(name: str, values: Any) -> Any:
    typ = _SECTION_TYPES[name]
    if isinstance(values, typ):
        return values
    if not isinstance(values, dict):
        raise TuningConfigError(f"{name}: {values!r} is invalid; allowed: a mapping")
    known = {f.name for f in fields(typ)}
    for k in values:
        if k not in known:
            raise TuningConfigError(
                f"{name}.{k}: unknown key; allowed: " + ", ".join(sorted(known)))
    return typ(**values)


def _check(cfg: TuningConfig) -> None:
    d, o, p = cfg.dataloader, cfg.optimizer, cfg.parallelism
    checks = [
        ("version", cfg.version, isinstance(cfg.version, int) and cfg.version >= 0,
         "an integer >= 0"),
        ("dataloader.batch_size", d.batch_size, _is_int(d.batch_size) and d.batch_size >= 1,
         "an integer >= 1"),
        ("dataloader.num_workers", d.num_workers, _is_int(d.num_workers) and d.num_workers >= 0,
         "an integer >= 0"),
        ("dataloader.pin_memory", d.pin_memory, isinstance(d.pin_memory, bool), "true or false"),
        ("optimizer.learning_rate", o.learning_rate,
         isinstance(o.learning_rate, (int, float)) and not isinstance(o.learning_rate, bool)
         and o.learning_rate > 0, "a number > 0"),
        ("optimizer.grad_accum_steps", o.grad_accum_steps,
         _is_int(o.grad_accum_steps) and o.grad_accum_steps >= 1, "an integer >= 1"),
        ("parallelism.reshard_after_forward", p.reshard_after_forward,
         p.reshard_after_forward is None or isinstance(p.reshard_after_forward, bool),
         "true, false or null"),
        ("parallelism.activation_checkpointing", p.activation_checkpointing,
         p.activation_checkpointing is None or isinstance(p.activation_checkpointing, bool),
         "true, false or null"),
    ]
    for key, value, ok, allowed in checks:
        if not ok:
            raise TuningConfigError(f"{key}: {value!r} is invalid; allowed: {allowed}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
