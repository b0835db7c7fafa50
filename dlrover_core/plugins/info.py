"""What the plugin manager knows of one plugin (``dlrover plugins list``), and the
names blocked by ``DLROVER_DISABLE_PLUGINS``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

DISABLE_ENV = "DLROVER_DISABLE_PLUGINS"


class PluginStatus(StrEnum):
    """A plugin's state; compares equal to its string."""

    ACTIVE = "active"    # loaded and registered
    BLOCKED = "blocked"  # named in DLROVER_DISABLE_PLUGINS, never imported
    FAILED = "failed"    # its import or registration raised


@dataclass
class PluginInfo:
    """One plugin as ``dlrover plugins list`` shows it.

    ``status`` is a ``PluginStatus``: ``active`` (loaded and registered), ``blocked``
    (named in ``DLROVER_DISABLE_PLUGINS``, never imported) or ``failed`` (its import
    or registration raised; ``error`` holds the exception).
    """

    name: str
    version: str = ""
    distribution: str = ""
    hooks: list[str] = field(default_factory=list)
    provides: list[str] = field(default_factory=list)
    status: PluginStatus = PluginStatus.ACTIVE
    error: str = ""
    module: Any = field(default=None, repr=False)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "distribution": self.distribution,
            "hooks": sorted(self.hooks),
            "provides": sorted(self.provides),
            "status": self.status.value,
            "error": self.error,
        }

    def fail(self, error: str) -> None:
        self.status, self.error = PluginStatus.FAILED, error


def disabled_plugins(env: dict | None = None) -> set[str]:
    """Names listed in ``DLROVER_DISABLE_PLUGINS`` (comma separated)."""
    raw = (env if env is not None else os.environ).get(DISABLE_ENV, "")
    return {n.strip() for n in raw.split(",") if n.strip()}
