"""Plugin system: hook specifications, registered records and the plugin manager."""

from __future__ import annotations

from dlrover_core.plugins.hookspecs import hookimpl, hookspec
from dlrover_core.plugins.manager import (
    PluginInfo,
    PluginManager,
    UnknownPluginError,
    get_plugin_manager,
    reset_plugin_manager,
)

__all__ = [
    "PluginInfo",
    "PluginManager",
    "UnknownPluginError",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "reset_plugin_manager",
]
