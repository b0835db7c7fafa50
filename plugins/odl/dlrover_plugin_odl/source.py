"""The stream-source interface and the embedded ``replay`` source.

A stream is split into ``num_partitions`` partitions, one per instance of the
``source`` role (``partition`` = its rank). Every record read carries its
``position`` in the partition; positions of one partition increase in the order
the records are read. Delivery is at-least-once: the trainer checkpoints, per
partition, the position of the last record it trained, and after a restart the
driver calls :meth:`StreamSourceBase.seek` with it, so the source hands out again
everything after that position. :meth:`StreamSourceBase.commit` tells the source
that a committed checkpoint holds everything up to a position (a broker may now
forget those records: Redis ``XACK``).

A job resumed with fewer partitions than its checkpoint has offsets for: partition
``k >= num_partitions`` is *departed*, and the driver hands its checkpointed position
to partition ``k % num_partitions`` (:meth:`StreamSourceBase.take_over`). A source
that can still reach a departed partition's records delivers them under that
partition's offset key (:attr:`ReadResult.partition`) and is told of its commits by
:meth:`StreamSourceBase.commit_taken_over`; the defaults do nothing (the replay
source re-partitions its records by ``num_partitions`` anyway).

Write a source as a subclass, register it with the ``dlrover_stream_sources`` hook
(a :class:`dlrover_core.plugins.records.StreamSource` record naming the class), and
select it with ``config.odl.source.kind``.
"""

from __future__ import annotations

import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dlrover_core.spec.errors import SpecError


@dataclass
class ReadResult:
    """What one :meth:`StreamSourceBase.read` returns.

    Attributes:
        positions: position of each record in the partition, increasing.
        records: the records (JSON-like dicts; ``id`` identifies one for counting).
        end: the partition has no more records, now or later (a finite replay).
        partition: ``None`` when the positions are this source's own partition's;
            else the departed partition (``k >= num_partitions``) they belong to
            (its offset in the trainer's checkpoint advances with them).
    """

    positions: list
    records: list
    end: bool = False
    partition: int | None = None


class StreamSourceBase(ABC):
    """One partition of a stream, in the ``source`` role's worker process.

    Args:
        options: ``config.odl.source.options`` of the job.
        partition: this instance's partition (its rank). num_partitions: the
            ``source`` role's ``total``.
        job: the job name (e.g. for a consumer name).
    """

    def __init__(self, options: dict, partition: int, num_partitions: int, job: str = "") -> None:
        self.options = dict(options)
        self.partition = partition
        self.num_partitions = num_partitions
        self.job = job

    @abstractmethod
    def seek(self, position: Any | None) -> None:
        """Resume after ``position`` (the last position trained, from the trainer's
        checkpoint), or from the start of what is not yet committed when ``None``."""

    @abstractmethod
    def read(self, max_records: int, timeout_s: float) -> ReadResult:
        """Up to ``max_records`` records after the last one read, waiting at most
        ``timeout_s`` seconds for the first; may return none."""

    def take_over(self, positions: dict[int, Any]) -> None:
        """Called after :meth:`seek` on every start: ``positions`` maps each departed
        partition ``k`` (``k >= num_partitions``, ``k % num_partitions ==
        partition``) that the trainer's checkpoint has an offset for to that offset.
        Records of departed partitions, if the source can reach them, are read
        before this partition's own. Default: nothing."""

    def commit(self, position: Any) -> None:
        """A committed trainer checkpoint holds every record up to ``position``."""

    def commit_taken_over(self, partition: int, position: Any) -> None:
        """A committed trainer checkpoint holds every record of the departed
        ``partition`` (taken over by this source) up to ``position``. Default:
        nothing."""

    def stats(self) -> dict[str, float]:
        """Counters for the driver's metrics (``name -> number``)."""
        return {}

    def close(self) -> None:
        """Release connections."""


# ---------------------------------------------------------------------------- replay
def validate_replay_options(options: dict) -> None:
    """``records`` (required): import path ``pkg.mod:fn`` of a function returning an
    iterable of records (dicts) in stream order; a generator function works, and
    may be endless. ``kwargs``: keyword arguments for it. ``rate``: records per
    second per partition at most (0: as fast as read)."""
    known = {"records", "kwargs", "rate"}
    for k, v in options.items():
        if k not in known:
            raise SpecError(f"config.odl.source.options.{k}", v,
                            "options of the replay source: " + ", ".join(sorted(known)))
    path = options.get("records")
    if not isinstance(path, str) or ":" not in path:
        raise SpecError("config.odl.source.options.records", path,
                        "an import path 'package.module:function' returning an iterable of "
                        "records")
    if not isinstance(options.get("kwargs") or {}, dict):
        raise SpecError("config.odl.source.options.kwargs", options.get("kwargs"), "a mapping")
    rate = options.get("rate", 0)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
        raise SpecError("config.odl.source.options.rate", rate, "records per second >= 0")


class ReplaySource(StreamSourceBase):
    """The embedded source: replays an iterable of records in order as a stream.

    Record ``i`` of the iterable (from 0) goes to partition ``i % num_partitions``
    at position ``i``, so a stream read by several source instances keeps its
    global order within each partition. Records without an ``id`` get ``id = i``.
    ``seek(p)`` rebuilds the iterable and skips records up to ``p`` (replays are
    deterministic by contract); it reads the first record after ``p`` ahead.
    """

    def __init__(self, options: dict, partition: int, num_partitions: int, job: str = "") -> None:
        super().__init__(options, partition, num_partitions, job)
        validate_replay_options(self.options)
        from dlrover_core.plugins.records import resolve

        self._factory: Callable[..., Iterable[dict]] = resolve(self.options["records"])
        self._kwargs = dict(self.options.get("kwargs") or {})
        self._rate = float(self.options.get("rate", 0) or 0)
        self._it: Iterator[tuple[int, dict]] | None = None
        self._next_t = 0.0
        self.read_records = 0
        self.seek(None)

    def _records(self) -> Iterator[tuple[int, dict]]:
        n, p = self.num_partitions, self.partition
        for i, rec in enumerate(self._factory(**self._kwargs)):
            if i % n == p:
                if "id" not in rec:
                    rec = {**rec, "id": i}
                yield i, rec

    def seek(self, position: Any | None) -> None:
        """Rebuild the iterable and skip up to ``position``, then take its next record
        now: the records function's own start (loading a file, the skipping) happens
        here, when the driver opens the stream, not in the first read."""
        it = self._records()
        if position is not None:
            it = itertools.dropwhile(lambda pr: pr[0] <= int(position), it)
        first = next(it, None)
        self._it = it if first is None else itertools.chain([first], it)

    def read(self, max_records: int, timeout_s: float) -> ReadResult:
        assert self._it is not None
        positions, records = [], []
        end = False
        deadline = time.monotonic() + timeout_s
        for _ in range(max_records):
            if self._rate:
                wait = self._next_t - time.monotonic()
                if wait > 0:
                    if positions and time.monotonic() + wait > deadline:
                        break
                    time.sleep(wait)
                self._next_t = max(self._next_t, time.monotonic()) + 1.0 / self._rate
            try:
                pos, rec = next(self._it)
            except StopIteration:
                end = True
                break
            positions.append(pos)
            records.append(rec)
        self.read_records += len(records)
        return ReadResult(positions, records, end)

    def stats(self) -> dict[str, float]:
        return {"source_read_records": float(self.read_records)}
