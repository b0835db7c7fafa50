"""The ``config.odl`` section of an ``odl`` job: the stream, its buffers and delivery.

Pure Python (no torch), so the template's ``apply`` can validate a spec in the
client before anything starts. The driver and every workload read the same
section with :meth:`ODLConfig.from_config`.

Example (YAML)::

    config:
      odl:
        source: {kind: replay, options: {records: examples.odl_shuttle.data:shuttle_records}}
        batch_size: 64        # records per optimizer step (test, then train)
        chunk_batches: 32     # batches per chunk (one source read: 2048 records)
        buffer: 4             # chunks between source and trainer, at most
        publish_every: 50     # trainer steps between published model versions
        publish_every_s: 0    # and/or seconds between them (0: off)
        checkpoint_every_s: 0 # seconds between checkpoints, besides checkpoint.every_steps
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.fields import check_fields, read_fields, spec_field
from dlrover_core.spec.values import plain


@dataclass(frozen=True)
class SourceConfig:
    """``kind``: a registered stream source (``replay``, ``redis`` or a plugin's);
    ``options``: that source's settings (see its README)."""

    kind: str = "replay"
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ODLConfig:
    """Settings of a streaming job (all optional).

    Stream:
        source: :class:`SourceConfig`. batch_size: records per optimizer step
            (each is scored, then trained on: prequential). chunk_batches: batches per
            chunk (default 1); a chunk, up to ``chunk_batches * batch_size`` records
            of one partition, is the unit the source reads, a preprocess instance
            transforms and a trainer rank takes in one call, running one optimizer
            step per ``batch_size`` records of it in order: the learning is that of
            ``batch_size``, the Ray calls per record are ``chunk_batches`` times
            fewer. buffer: chunks held between the source and the trainer at most
            (being read, being preprocessed, or waiting), so at most ``buffer *
            chunk_batches * batch_size`` records are in flight: a slow trainer slows
            the source (backpressure). read_timeout_s: how long one read waits for
            records before returning fewer (or none). train_depth: trainer calls
            (one chunk per rank each) sent ahead (the trainer runs them in order; the
            driver prepares the next while one trains); 1: wait for each.
    Ending (the first that holds; all 0 with an endless source: run until stopped):
        max_records: records trained. max_time_s: seconds of streaming.
        idle_timeout_s: seconds without a new record (an idle broker).
    Delivery and models:
        publish_every: trainer steps between published model versions (0: only at
            the end), written to ``<job dir>/published`` after the trainer call in
            which a multiple of it is reached. publish_every_s: seconds between
            published versions as well (0: off): the driver asks for one with the
            first trainer call it sends once that many seconds have passed since
            the stream started or since the call it last asked on.
            checkpoint_every_s: the same cadence in seconds for checkpoints (0: off;
            besides ``checkpoint.every_steps``): the asked call saves its starting
            step, as a step-cadence checkpoint is saved. One clock (the driver's)
            decides for every trainer rank, so DDP ranks save the same steps.
            report_every: trainer steps between
            metric reports (likewise at the end of a call). window: records in the
            sliding prequential accuracy (whole trainer calls). log_record_ids
            (default true): every source instance appends the records it hands out,
            and every trainer rank the ids it trained, to logs under ``<job
            dir>/odl/``, from which the driver counts ``lost`` and ``duplicated``
            records at the end (:mod:`dlrover_plugin_odl.ledger`; one
            short line per record and stage: turn it off for an endless stream).
    """

    source: SourceConfig = field(default_factory=SourceConfig)
    batch_size: int = spec_field(64, ge=1)
    chunk_batches: int = spec_field(1, ge=1)
    buffer: int = spec_field(4, ge=1)
    read_timeout_s: float = spec_field(1.0, gt=0, unit="seconds")
    train_depth: int = spec_field(2, ge=1)
    max_records: int = spec_field(0, ge=0, note="0: off")
    max_time_s: float = spec_field(0.0, ge=0, unit="seconds", note="0: off")
    idle_timeout_s: float = spec_field(0.0, ge=0, unit="seconds", note="0: off")
    publish_every: int = spec_field(50, ge=0, note="0: off")
    publish_every_s: float = spec_field(0.0, ge=0, unit="seconds", note="0: off")
    checkpoint_every_s: float = spec_field(0.0, ge=0, unit="seconds", note="0: off")
    report_every: int = spec_field(1, ge=1)
    window: int = spec_field(1000, ge=1)
    log_record_ids: bool = True

    @classmethod
    def from_config(cls, config: Any) -> ODLConfig:
        """Read ``config.odl`` (a mapping or OmegaConf node; missing: defaults).

        Raises:
            SpecError: an unknown key or a value out of range, naming
                ``config.odl.<key>``.
        """
        raw = plain(config.get("odl") if config is not None else None) or {}
        if not isinstance(raw, Mapping):
            raise SpecError("config.odl", raw, "a mapping of ODL settings")
        known = {f.name: f for f in dataclasses.fields(cls)}
        for k in raw:
            if k not in known:
                raise SpecError(f"config.odl.{k}", raw[k], "one of " + ", ".join(sorted(known)))
        src = raw.get("source") or {}
        if isinstance(src, str):
            src = {"kind": src}
        if not isinstance(src, Mapping):
            raise SpecError("config.odl.source", src, "a mapping {kind, options}")
        for k in src:
            if k not in ("kind", "options"):
                raise SpecError(f"config.odl.source.{k}", src[k], "kind, options")
        options = src.get("options") or {}
        if not isinstance(options, Mapping):
            raise SpecError("config.odl.source.options", options, "a mapping")
        kind = src.get("kind", "replay")
        if not isinstance(kind, str) or not kind:
            raise SpecError("config.odl.source.kind", kind, "the name of a stream source")
        values = read_fields(cls, raw, "config.odl", [k for k in known if k != "source"])
        out = cls(source=SourceConfig(kind, dict(options)), **values)
        out.check()
        return out

    def check(self) -> None:
        """The fields' declared ranges (:func:`dlrover_core.spec.fields.check_fields`).
        Raises ``SpecError``."""
        check_fields(self, ODLConfig, "config.odl")

    @property
    def chunk_size(self) -> int:
        """Records per chunk at most: ``batch_size * chunk_batches``."""
        return self.batch_size * self.chunk_batches

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

