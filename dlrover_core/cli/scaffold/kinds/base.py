"""The record of one kind of scaffolded plugin.

Each :class:`Kind` lists its files (path -> text with the placeholders of
:mod:`dlrover_core.cli.scaffold.common`), what ``dlrover plugins list`` will show it
providing, the hooks it implements, and its extra requirements.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kind:
    """One ``--kind`` of ``dlrover plugin new``."""

    name: str
    summary: str
    provides: tuple[str, ...]
    hooks: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)
    deps: tuple[str, ...] = ()
    layout: tuple[tuple[str, str], ...] = ()
    usage: str = ""
