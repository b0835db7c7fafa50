"""Looking up a stream source record in the plugin manager."""

from __future__ import annotations

from typing import Any

from dlrover_core.plugins.records import StreamSource


def get_stream_source(name: str, pm: Any = None) -> StreamSource:
    """The ``StreamSource`` record named ``name`` (registered through the
    ``dlrover_stream_sources`` hook).

    Raises:
        UnknownPluginError: no plugin provides it; the message lists the installed ones.
    """
    from dlrover_core.plugins.manager import get_plugin_manager

    pm = pm or get_plugin_manager()
    if hasattr(pm, "registry"):
        return pm.registry(StreamSource).get(name)
    return pm.get_stream_source(name)


def stream_sources(pm: Any = None) -> dict[str, StreamSource]:
    """Every installed stream source by name."""
    from dlrover_core.plugins.manager import get_plugin_manager

    pm = pm or get_plugin_manager()
    if hasattr(pm, "registry"):
        return pm.registry(StreamSource).all()
    return pm.stream_sources()
