"""Columnar chunks: a chunk's records as one array per field, from the source on.

A source reads records (dicts); the ``source`` role turns a chunk of them into
columns once (:func:`to_columns`) and puts those into Ray's object store, where a
NumPy array is one buffer that the ``preprocess`` worker maps without unpickling it
record by record, and a preprocess's :meth:`transform_columns
<dlrover_plugin_odl.workloads.PreprocessWorkload.transform_columns>` builds the batch's
tensors from whole columns instead of from lists of dicts.

Imports NumPy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["to_columns", "to_records"]


def _column(values: list) -> Any:
    """One field's values -> a NumPy array when NumPy reads them as numbers: every value
    a number (``[N]``) or a list of the same length of numbers (``[N, F]``); int64
    when all are integers, else float64. Otherwise (strings, booleans, ``None``,
    ragged lists, dicts) the list itself."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError):   # ragged nesting
        return values
    if arr.ndim not in (1, 2) or arr.shape[0] != len(values):
        return values
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind == "f":
        return arr.astype(np.float64, copy=False)
    return values


def to_columns(records: list[dict]) -> dict[str, Any]:
    """Row-wise records -> ``{field: column}``, one column per field any record has
    (fields in the order they first appear). A field every record has, with numbers
    (or same-length lists of numbers) in each, is a NumPy array of dim 0 = records
    (int64 when every value is an integer, else float64); any other field is a list
    of the values (``None`` where a record lacks it).

    Raises:
        TypeError: a record is not a dict.
    """
    fields: dict[str, None] = {}
    for r in records:
        if not isinstance(r, dict):
            raise TypeError(f"a stream record must be a dict, not {type(r).__name__}: {r!r}")
        fields.update(dict.fromkeys(r))
    out: dict[str, Any] = {}
    for f in fields:
        values = [r.get(f) for r in records]
        complete = all(f in r for r in records)
        out[f] = _column(values) if complete and values else values
    return out


def to_records(columns: dict[str, Any], n: int) -> list[dict]:
    """Columns -> ``n`` row-wise records (NumPy values as Python numbers or lists;
    fields that were missing, ``None`` in a list column, are left out): the
    inverse of :func:`to_columns` for a row-wise ``transform``."""
    rows: list[dict] = [{} for _ in range(n)]
    for f, col in columns.items():
        values = col.tolist() if isinstance(col, np.ndarray) else col
        for row, v in zip(rows, values):
            if v is not None:
                row[f] = v
    return rows
