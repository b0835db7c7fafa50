"""The worker logs' rotation settings (``observability.log_max_bytes`` /
``log_backups``, :mod:`dlrover_core.runtime.log_capture`): defaults and the smallest
file size allowed. Imports nothing, so the spec schema and the workers share it."""

#: bytes per log file before it is rotated (10 MiB)
DEFAULT_LOG_MAX_BYTES = 10 << 20
#: rotated parts kept
DEFAULT_LOG_BACKUPS = 3
#: the smallest ``log_max_bytes`` allowed
MIN_LOG_BYTES = 1024
