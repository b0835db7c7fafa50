"""Lazy package attributes (PEP 562): a package names what it exports and the module
each comes from, and imports that module on first use, so importing the package (what
a plugin's entry-point module does) stays light."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, exports: dict[str, str],
                 namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: ``name`` is imported from
    ``exports[name]`` (a module path) and kept in ``namespace`` (the package's
    ``globals()``), so later lookups skip the function.

    Raises (from the returned function):
        AttributeError: ``name`` is not in ``exports``.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
