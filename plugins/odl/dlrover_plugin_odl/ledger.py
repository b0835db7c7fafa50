"""The record ledger of an ``odl`` job: which records were handed out, which trained.

With ``config.odl.log_record_ids`` (the default), two append-only logs live under
``<job dir>/odl/``, kept across restarts and runs (they grow by one short line per
record and stage: turn the option off for an endless stream):

- ``handed_out/partition<key>.txt``: every record a ``source`` instance returned
  from a read, one line ``<position>\\t<id>``, in read order, one file per partition
  key (the partition whose offset the position advances: one writer at a time, also
  when a source takes a departed partition over);
- ``trained/rank<r>.txt``: the id of every record a ``trainer`` rank trained on, one
  line ``<step>\t<id>`` (``step``: the trainer's step when the call began), written
  after its optimizer steps; and, each time the rank starts (or is set up again) from
  step ``S``, a line ``#restored\t<S>``: the entries of step ``S`` or later written
  before it were trained by a model that was thrown away (a restart from the
  checkpoint of step ``S``), so they no longer count as trained (:func:`lineage`).

A record's id is its ``id`` field, or ``<key>@<position>`` when it has none
(:func:`record_id`); ids are compared as text and must not hold a tab or a line
break. Each source read and each trainer step
appends its lines with one write (no per-record I/O call).

At the end of the job the driver counts (:func:`count`):

- ``duplicated``: training runs beyond the first of each record in the model's
  lineage (0 when every record was trained once by the model that went on; a
  trainer restarted from its checkpoint trains again what it trained after it, and
  the thrown-away runs are not counted here but as ``retrained``);
- ``retrained``: training runs thrown away by a restart (the work a fault cost);
- ``lost``: records *due* that no trainer rank trained. Due: every record handed
  out when the stream ended; when the job stopped earlier (``max_records``,
  ``max_time_s``, ``idle_timeout_s``), the records of each partition at or before
  its final offset (the last trained position), in the order the partition first
  handed its positions out; those read ahead of it stay unacknowledged, for the
  next run.

What a broker never handed to a source is not in the ledger: the sources' own
contract (the ``redis`` source hands entries out in id order without gaps) covers
that, and its tests count against the records produced.
"""

from __future__ import annotations

import collections
import glob
import os
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

HANDED_OUT = "handed_out"
TRAINED = "trained"


def record_id(record: dict, key: Any, position: Any) -> str:
    """The ledger's id of a record: ``str(record["id"])``, or ``"<key>@<position>"``
    when the record has no ``id`` (or it is ``None``)."""
    rid = record.get("id") if isinstance(record, dict) else None
    return f"{key}@{position}" if rid is None else str(rid)


def column_ids(ids: Any, key: Any, positions: list) -> list[str]:
    """:func:`record_id` of each record of a columnar chunk: ``ids`` is its ``id``
    column (an array, a list with ``None`` where a record has none, or ``None`` when
    no record has one) and ``positions`` the records' positions."""
    if ids is None:
        return [f"{key}@{p}" for p in positions]
    values = ids.tolist() if hasattr(ids, "tolist") else ids
    return [f"{key}@{p}" if v is None else str(v) for v, p in zip(values, positions)]


def open_log(job_dir: str | None, kind: str, name: Any) -> TextIO | None:
    """The append-mode log ``<job_dir>/odl/<kind>/<prefix><name>.txt``: ``kind``
    :data:`TRAINED` (prefix ``rank``, ``name`` the trainer rank) or
    :data:`HANDED_OUT` (prefix ``partition``, ``name`` the partition key); ``None``
    without a job directory."""
    if not job_dir:
        return None
    d = os.path.join(job_dir, "odl", kind)
    os.makedirs(d, exist_ok=True)
    prefix = "partition" if kind == HANDED_OUT else "rank"
    return open(os.path.join(d, f"{prefix}{name}.txt"), "a")  # noqa: SIM115 - caller closes


def write_handed_out(log: TextIO, positions: Sequence, ids: Iterable[str]) -> None:
    """Append one chunk's records to its partition's :data:`HANDED_OUT` log (one
    write, flushed)."""
    log.write("".join(f"{p}\t{i}\n" for p, i in zip(positions, ids)))
    log.flush()


#: the marker line of a :data:`TRAINED` log: the rank (re)started from this step
RESTORED = "#restored"


def write_trained(log: TextIO, ids: Iterable[Any], step: int | None = None) -> None:
    """Append one chunk's record ids to a :data:`TRAINED` log (one write, flushed),
    each as ``<step>\t<id>`` (``step``: the trainer's step when the call began) or, with
    ``step=None``, ``<id>`` (never dropped by a restore)."""
    prefix = "" if step is None else f"{int(step)}\t"
    log.write("".join(f"{prefix}{i}\n" for i in ids))
    log.flush()


def write_restored(log: TextIO, step: int) -> None:
    """Mark in a :data:`TRAINED` log that the rank starts from step ``step`` (its
    checkpoint; 0: from scratch): earlier entries of step ``step`` or later are out of
    the model's lineage (:func:`lineage`)."""
    log.write(f"{RESTORED}\t{int(step)}\n")
    log.flush()


def lineage(lines: Iterable[str]) -> tuple[list[str], int]:
    """``(ids, dropped)`` of one :data:`TRAINED` log: the record ids the surviving model
    trained on, in order, and how many entries restores threw away."""
    entries: list[tuple[int | None, str]] = []
    dropped = 0
    for line in lines:
        head, sep, tail = line.partition("\t")
        if head == RESTORED:
            keep = [e for e in entries if e[0] is None or e[0] < int(tail)]
            dropped += len(entries) - len(keep)
            entries = keep
        elif sep:
            entries.append((int(head), tail))
        else:
            entries.append((None, line))
    return [rid for _, rid in entries], dropped


def _lines(path: str) -> Iterable[str]:
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if line:
                yield line


def trained_ids(job_dir: str) -> collections.Counter:
    """record id -> how many times the model that went on trained it, from every
    rank's :data:`TRAINED` log under ``job_dir`` (:func:`lineage`)."""
    return _trained(job_dir)[0]


def _trained(job_dir: str) -> tuple[collections.Counter, int]:
    trained: collections.Counter = collections.Counter()
    dropped = 0
    for path in glob.glob(os.path.join(job_dir, "odl", TRAINED, "rank*.txt")):
        ids, d = lineage(_lines(path))
        trained.update(ids)
        dropped += d
    return trained, dropped


def count(job_dir: str, offsets: dict[str, Any], ended: bool) -> dict[str, float]:
    """``{"lost", "duplicated", "retrained", "handed_out", "trained"}`` (floats,
    records) from the logs under ``job_dir`` (see the module docstring). ``offsets``:
    the final ``partition key -> last trained position``; ``ended``: the stream ended
    (every record handed out is due)."""
    trained, dropped = _trained(job_dir)
    due: set[str] = set()
    handed: set[str] = set()
    for path in glob.glob(os.path.join(job_dir, "odl", HANDED_OUT, "partition*.txt")):
        key = os.path.basename(path)[len("partition"):-len(".txt")]
        rows = [tuple(line.split("\t", 1)) for line in _lines(path)]
        handed.update(rid for _, rid in rows)
        if ended:
            due.update(rid for _, rid in rows)
            continue
        if key not in offsets:
            continue
        # positions in partition order: the order of their first hand-out (a seek
        # back hands the same positions out again, in the same order)
        order: dict[str, int] = {}
        for pos, _ in rows:
            order.setdefault(pos, len(order))
        cut = order.get(str(offsets[key]), -1)
        due.update(rid for pos, rid in rows if order[pos] <= cut)
    return {"lost": float(len(due - trained.keys())),
            "duplicated": float(sum(trained.values()) - len(trained)),
            "retrained": float(dropped),
            "handed_out": float(len(handed)), "trained": float(len(trained))}
