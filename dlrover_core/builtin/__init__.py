"""The core's built-in plugin (defaults registered through the hooks)."""
