"""How the ``dlrover`` command prints tables and JSON.

Rules, so that nothing a user reads is cut off and no table is wider than the screen:

- On a terminal a table fits the terminal's width; when the stream is not a terminal
  (piped, redirected, captured by CI) it fits ``$COLUMNS`` columns, or
  :data:`PIPE_WIDTH` when that is not set; there a message (not a table) is printed
  on one line, however long, so that it can be searched with ``grep``.
- A table narrower than that width is as wide as its content. A wider one folds its
  long cells onto more lines at spaces: :func:`fit_widths` gives every column at least
  its longest word (so words are not split) and its short cells whole
  (:data:`SHORT_CELL`), and shares the rest of the width in
  proportion to what each column lacks; a word longer than its column's share (a long
  path) is folded, never ended with an ellipsis.
- A column that is empty in every row is left out (:func:`print_table`).
- Restart counts print in one order everywhere (:func:`format_restarts`): the total, then
  the failover levels from the smallest scope to the largest.

Every command that prints a table also takes ``--json``; :func:`print_json` writes it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any, Iterable, Mapping, Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

#: Console width (columns) when the output is not a terminal and ``$COLUMNS`` is unset.
PIPE_WIDTH = 120

#: A cell up to this many characters is not folded at its spaces (a date and time, an
#: age such as ``16 s``) unless even the columns' longest words do not fit.
SHORT_CELL = 20


def _pipe_width() -> int:
    try:
        return max(20, int(os.environ.get("COLUMNS", "")))
    except ValueError:
        return PIPE_WIDTH


def console_for(stream: IO[str] | None = None, stderr: bool = False) -> Console:
    """A rich ``Console`` writing to ``stream`` (default stdout, or stderr when
    ``stderr``): the terminal's width on a terminal; otherwise ``$COLUMNS`` (else
    :data:`PIPE_WIDTH`) columns and no colour or other ANSI codes."""
    stream = stream or (sys.stderr if stderr else sys.stdout)
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return Console(file=stream)
    return Console(file=stream, width=_pipe_width(), color_system=None, force_terminal=False,
                   soft_wrap=True)


def fit_widths(minimums: Sequence[int], maximums: Sequence[int], available: int) -> list[int]:
    """Content widths of columns that share ``available`` characters.

    ``maximums`` are the widths the columns' content needs on one line, ``minimums``
    their longest words. When the maximums fit they are the answer. Otherwise each
    column gets its minimum (capped at its maximum) and the rest of ``available`` is
    shared in proportion to ``maximum - minimum``; when even the minimums do not fit,
    every column gets an equal share of the excess taken off (never below 1), so long
    words fold.
    """
    maxs = [max(1, m) for m in maximums]
    if sum(maxs) <= available:
        return maxs
    mins = [max(1, min(lo, hi)) for lo, hi in zip(minimums, maxs)]
    spare = available - sum(mins)
    if spare < 0:
        widths = list(mins)
        excess = -spare
        while excess > 0 and any(w > 1 for w in widths):
            widest = max(widths)
            i = widths.index(widest)
            widths[i] -= 1
            excess -= 1
        return widths
    lack = [hi - lo for lo, hi in zip(mins, maxs)]
    total = sum(lack)
    widths = [lo + spare * d // total for lo, d in zip(mins, lack)]
    leftover = available - sum(widths)
    for i in sorted(range(len(widths)), key=lambda i: lack[i], reverse=True)[:leftover]:
        widths[i] += 1
    return widths


def make_table(columns: Sequence[str], title: str | None = None, **kwargs: Any) -> Table:
    """A table whose columns fold long cells instead of cutting them."""
    t = Table(title=title, **kwargs)
    for col in columns:
        t.add_column(col, overflow="fold")
    return t


def fit_table(table: Table, console: Console) -> Table:
    """Set the width of every column of ``table`` by :func:`fit_widths` so that it fits
    ``console``'s width, folding at spaces; returns ``table``."""
    cols = table.columns
    if not cols:
        return table
    options = console.options
    words, lows, highs = [], [], []
    for col in cols:
        cells = [col.header, *col.cells]
        ms = [Measurement.get(console, options, c) for c in cells]
        words.append(max(m.minimum for m in ms))
        lows.append(max(max(m.minimum, min(m.maximum, SHORT_CELL)) for m in ms))
        highs.append(max(m.maximum for m in ms))
    pad = table.padding[1] + table.padding[3]
    frame = (len(cols) - 1 + (2 if table.show_edge else 0)) if table.box else 0
    available = console.width - frame - pad * len(cols)
    if sum(min(lo, hi) for lo, hi in zip(lows, highs)) > available:
        lows = words  # short cells fold too, so that fewer words are split
    for col, w in zip(cols, fit_widths(lows, highs, available)):
        col.width = w
    return table


def print_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None,
                console: Console | None = None, keep_empty: bool = False) -> None:
    """Print ``rows`` (each a sequence of cells, converted with ``str``) as a table that
    fits ``console`` (:func:`fit_table`). A column whose cells are all empty (``None``
    or ``""``) is left out unless ``keep_empty`` (or there are no rows)."""
    rows = [["" if c is None else str(c) for c in row] for row in rows]
    keep = [i for i in range(len(columns))
            if keep_empty or not rows or any(r[i] != "" for r in rows)]
    console = console or console_for()
    t = make_table([columns[i] for i in keep], title)
    for row in rows:
        t.add_row(*(row[i] for i in keep))
    widths = [c.width for c in fit_table(t, console).columns]
    # again, with paths longer than their column folded at their separators
    t = make_table([columns[i] for i in keep], title)
    for row in rows:
        t.add_row(*(fold_path(row[i], w or 0) for i, w in zip(keep, widths)))
    for col, w in zip(t.columns, widths):
        col.width = w
    console.print(t)


def fold_path(cell: str, width: int) -> str:
    """``cell`` with each word longer than ``width`` that holds a ``/`` broken into lines
    after a ``/`` (``/tmp/runs/`` / ``nanogpt``), so that a path folds between its parts
    rather than inside a name; words with markup (``[green]``) are left as they are,
    and a part longer than ``width`` is left for the table to fold."""
    if width <= 0 or len(cell) <= width or "/" not in cell:
        return cell
    out = []
    for word in cell.split(" "):
        if len(word) <= width or "/" not in word or "[" in word:
            out.append(word)
            continue
        lines, line = [], ""
        for part in word.split("/")[:-1]:
            piece = part + "/"
            if line and len(line) + len(piece) > width:
                lines.append(line)
                line = ""
            line += piece
        last = word.rsplit("/", 1)[1]
        if line and len(line) + len(last) > width:
            lines.append(line)
            line = ""
        lines.append(line + last)
        out.append("\n".join(lines))
    return " ".join(out)


def format_restarts(restarts: Mapping[str, int] | None) -> str:
    """``"3 (process 2, node 1)"``: a summary's or status's ``restarts`` (``total`` and a
    count per failover level) in one order, the total first, then the levels from the
    smallest scope to the largest (:data:`dlrover_core.plugins.records.FailoverLevel`),
    levels with no restart left out; ``"0"`` for none."""
    from dlrover_core.plugins.records import FailoverLevel

    restarts = dict(restarts or {})
    total = int(restarts.pop("total", sum(restarts.values())))
    order = [lvl.value for lvl in FailoverLevel]
    levels = sorted(restarts, key=lambda k: (order.index(k) if k in order else len(order), k))
    parts = [f"{k} {restarts[k]}" for k in levels if restarts[k]]
    return f"{total}" + (f" ({', '.join(parts)})" if parts else "")


def print_json(obj: Any, stream: IO[str] | None = None) -> None:
    """Write ``obj`` as indented JSON (non-JSON values through ``str``) and a newline."""
    stream = stream or sys.stdout
    stream.write(json.dumps(obj, indent=1, default=str) + "\n")
    stream.flush()


class _Stderr:
    """Messages to the current ``sys.stderr`` (looked up at each print, so that a
    redirected or captured stderr gets them), through :func:`console_for`."""

    def print(self, *objects, **kwargs) -> None:
        console_for(stderr=True).print(*objects, **kwargs)


err = _Stderr()
