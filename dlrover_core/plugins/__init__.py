"""Plugin system: hook specifications, registered records and the plugin manager.

Names are imported on first use, so ``dlrover_core.plugins.hookspecs`` (what a plugin
module needs) does not load the manager and stevedore.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlrover_core.lazy import lazy_getattr

_EXPORTS: dict[str, str] = {
    "hookimpl": "dlrover_core.plugins.hookspecs",
    "hookspec": "dlrover_core.plugins.hookspecs",
    "PluginInfo": "dlrover_core.plugins.info",
    "PluginManager": "dlrover_core.plugins.manager",
    "PluginStatus": "dlrover_core.plugins.info",
    "UnknownPluginError": "dlrover_core.plugins.registry",
    "PluginError": "dlrover_core.plugins.registry",
    "Registry": "dlrover_core.plugins.registry",
    "get_plugin_manager": "dlrover_core.plugins.manager",
    "reset_plugin_manager": "dlrover_core.plugins.manager",
}

__all__ = ["PluginError", "PluginInfo", "PluginManager", "PluginStatus", "Registry",
    "UnknownPluginError", "get_plugin_manager", "hookimpl", "hookspec",
    "reset_plugin_manager"]

if TYPE_CHECKING:
    from dlrover_core.plugins.hookspecs import hookimpl, hookspec
    from dlrover_core.plugins.manager import (
        PluginInfo,
        PluginManager,
        PluginStatus,
        get_plugin_manager,
        reset_plugin_manager,
    )
    from dlrover_core.plugins.registry import PluginError, Registry, UnknownPluginError


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
