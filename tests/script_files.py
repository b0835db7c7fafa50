"""Load a script of this repository (``benchmarks/*.py``, ``scripts/*.py``) as a module,
for tests of its functions without running it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, name: str) -> ModuleType:
    """The module of ``ROOT/relative_path``, executed under ``name`` (not added to
    ``sys.modules``).

    Raises:
        FileNotFoundError: no such file.
    """
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
