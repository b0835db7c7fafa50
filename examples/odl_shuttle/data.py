"""The Statlog (Shuttle) dataset as a stream: 49,097 records of 9 numeric sensor
attributes of a NASA space shuttle, labelled normal (0) or anomaly (1, about 7%).

It ships inside the ``river`` package (``river.datasets.Shuttle``, a gzipped CSV in
the wheel): nothing is downloaded. Per the UCI description the first attribute
(``f1``) is time; :func:`shuttle_records` replays the records ordered by it
(stable sort, so records of the same time keep the file's order), or in the
file's order with ``order="file"``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

FEATURES = 9


@functools.lru_cache(maxsize=2)
def _load(order: str) -> tuple[tuple[tuple[float, ...], int], ...]:
    from river.datasets import Shuttle

    rows = [(tuple(float(x[f"f{k}"]) for k in range(1, FEATURES + 1)), int(y))
            for x, y in Shuttle()]
    if order == "time":
        rows.sort(key=lambda r: r[0][0])  # list.sort is stable
    elif order != "file":
        raise ValueError(f"order={order!r}; allowed: time, file")
    return tuple(rows)


def shuttle_records(limit: int = 0, order: str = "time", loops: int = 1) -> Iterator[dict]:
    """``{"id": i, "x": [9 floats], "y": 0 | 1}`` in stream order (``id`` = position in
    the replay); ``limit`` > 0 keeps the first ``limit`` records. ``loops``: times the
    records are replayed one after the other (0: endlessly, for a stream longer than
    the dataset); loop ``k``'s ids are ``k * n + i`` (``n`` records a loop), so ids stay
    unique."""
    rows = _load(order)
    rows = rows[:limit] if limit else rows
    k = 0
    while loops <= 0 or k < loops:
        for i, (x, y) in enumerate(rows):
            yield {"id": k * len(rows) + i, "x": list(x), "y": y}
        k += 1
