"""Where a job's code is imported from, and ``dlrover validate``'s check that it imports.

A role's ``workload: package.module:Class`` and the job's ``driver`` are imported in
the workers with these directories on ``sys.path`` (:func:`code_paths`): the
``--working-dir`` shipped with the job (Ray's ``runtime_env`` ``working_dir``) when
given, else the directory ``dlrover submit`` ran in; then the client's ``PYTHONPATH``.
:func:`check_imports` imports them here the same way, so that ``validate`` finds a
wrong path before anything starts.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from dlrover_core.spec.errors import SpecError


def code_paths(working_dir: str | None = None) -> list[str]:
    """The directories a job's code is imported from, first to last (absolute)."""
    first = os.path.abspath(working_dir) if working_dir else os.getcwd()
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return list(dict.fromkeys([first] + [os.path.abspath(p) for p in rest]))


def _import_paths(spec: Any) -> list[tuple[str, str]]:
    """``(key, "module:Class")`` of every role workload and of the driver."""
    from omegaconf import OmegaConf

    out = []
    for name, role in (spec.get("roles") or {}).items():
        if OmegaConf.is_missing(role, "workload") or not role.get("workload"):
            continue  # a script role (``command``): checked by load_spec
        out.append((f"roles.{name}.workload", str(role.workload)))
    if spec.get("driver"):
        out.append(("driver", str(spec.driver)))
    return out


def check_imports(spec: Any, working_dir: str | None = None) -> None:
    """Import every ``module:Class`` of ``spec`` (roles' ``workload``, ``driver``) with
    :func:`code_paths` in front of ``sys.path`` (restored afterwards).

    Raises:
        SpecError: naming the key (``roles.trainer.workload``), the path and the error
            of the import (``ModuleNotFoundError: No module named 'x'``), or the class
            missing from the module.
    """
    if working_dir and not os.path.isdir(working_dir):
        raise SpecError("--working-dir", working_dir, "an existing directory")
    paths = code_paths(working_dir)
    where = f"a module:Class importable from {os.pathsep.join(paths)}"
    saved = list(sys.path)
    sys.path[:0] = paths
    try:
        for key, path in _import_paths(spec):
            module, _, cls = path.partition(":")
            try:
                mod = importlib.import_module(module)
            except Exception as exc:  # noqa: BLE001 - any error of the user's import
                raise SpecError(key, path, where, f"{type(exc).__name__}: {exc}") from None
            if cls and not hasattr(mod, cls):
                raise SpecError(key, path, where,
                                f"module {module!r} ({getattr(mod, '__file__', '?')}) "
                                f"has no {cls!r}")
    finally:
        sys.path[:] = saved
