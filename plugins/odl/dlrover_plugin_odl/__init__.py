"""The ``odl`` (online learning) graph template for dlrover-core.

Light on import: torch is imported only by :mod:`dlrover_plugin_odl.workloads`,
:mod:`dlrover_plugin_odl.publish` and the driver; redis-py only by
:mod:`dlrover_plugin_odl.redis_source`.
"""

__version__ = "0.1.0"
