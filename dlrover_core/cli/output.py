"""How the ``dlrover`` command prints tables and JSON.

Two rules, so that nothing a user reads is cut off:

- When the stream is not a terminal (piped, redirected, captured by CI), the rich
  console gets a width of :data:`PIPE_WIDTH` columns, so a table is as wide as its
  content: a table is only as wide as it needs to be, so nothing is padded.
- On a terminal narrower than a table, every column folds long cells onto more lines
  (``overflow="fold"``) instead of ending them with an ellipsis.

Every command that prints a table also takes ``--json``; :func:`print_json` writes it.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any, Iterable, Sequence

from rich.console import Console
from rich.table import Table

#: Console width (columns) used when the output is not a terminal.
PIPE_WIDTH = 4096


def console_for(stream: IO[str] | None = None, stderr: bool = False) -> Console:
    """A rich ``Console`` writing to ``stream`` (default stdout, or stderr when
    ``stderr``), :data:`PIPE_WIDTH` columns wide when that stream is not a terminal."""
    stream = stream or (sys.stderr if stderr else sys.stdout)
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return Console(file=stream)
    return Console(file=stream, width=PIPE_WIDTH, soft_wrap=False)


def make_table(columns: Sequence[str], title: str | None = None, **kwargs: Any) -> Table:
    """A table whose columns fold long cells instead of cutting them."""
    t = Table(title=title, **kwargs)
    for col in columns:
        t.add_column(col, overflow="fold")
    return t


def print_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None,
                console: Console | None = None) -> None:
    """Print ``rows`` (each a sequence of cells, converted with ``str``) as a table."""
    t = make_table(columns, title)
    for row in rows:
        t.add_row(*("" if c is None else str(c) for c in row))
    (console or console_for()).print(t)


def print_json(obj: Any, stream: IO[str] | None = None) -> None:
    """Write ``obj`` as indented JSON (non-JSON values through ``str``) and a newline."""
    stream = stream or sys.stdout
    stream.write(json.dumps(obj, indent=1, default=str) + "\n")
    stream.flush()
