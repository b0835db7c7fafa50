"""The ``ppo`` and ``grpo`` graph templates for dlrover-core.

Light on import: the torch parts live in :mod:`dlrover_plugin_ppo.algo`,
:mod:`dlrover_plugin_ppo.workloads` and :mod:`dlrover_plugin_ppo.trainer`.
"""

__version__ = "0.1.0"
