"""Reading what the benchmarks print: the JSON object lines of their output files
(the last line of each run is one), for the plot scripts."""

from __future__ import annotations

import json
from typing import Callable


def json_objects(paths: list[str], wanted: Callable[[dict], bool], what: str) -> list[dict]:
    """Every line of ``paths`` (in order) that is a JSON object for which ``wanted`` is
    true; other lines (logs, progress) are skipped.

    Raises:
        SystemExit: a file cannot be read, or holds no such line (the message names
            the file and ``what`` was looked for).
    """
    found: list[dict] = []
    for path in paths:
        try:
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise SystemExit(f"cannot read {path!r}: {exc}") from exc
        before = len(found)
        for line in lines:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and wanted(obj):
                found.append(obj)
        if len(found) == before:
            raise SystemExit(f"{path!r} has no line of {what}")
    return found
