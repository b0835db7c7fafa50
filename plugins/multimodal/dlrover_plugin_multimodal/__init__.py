"""The ``multimodal`` graph template for dlrover-core.

Light on import: the torch parts live in :mod:`dlrover_plugin_multimodal.encoder`,
:mod:`dlrover_plugin_multimodal.fusion` and :mod:`dlrover_plugin_multimodal.driver`.
"""

__version__ = "0.1.0"
