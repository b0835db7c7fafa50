"""A plugin's entry-point module and ``from dlrover_core import hookimpl`` import
neither Ray nor torch (checked in a fresh interpreter through ``sys.modules``), and
the core's packages import without cycles in any order."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

HEAVY = ("ray", "torch", "deepspeed", "megatron")

CHECK = """
import importlib, json, sys
importlib.import_module({module!r})
from dlrover_core import hookimpl, Backend, GraphTemplate, Failure
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))
"""


def entry_point_modules() -> list[str]:
    eps = importlib.metadata.entry_points(group="dlrover.plugins")
    return sorted({ep.value.split(":")[0] for ep in eps})


def heavy_modules_after(module: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", CHECK.format(module=module, heavy=HEAVY)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_some_plugins_are_installed():
    assert "dlrover_plugin_fsdp.plugin" in entry_point_modules()


@pytest.mark.parametrize("module", ["dlrover_core", "dlrover_core.plugins.hookspecs",
                                    *entry_point_modules()])
def test_entry_point_module_imports_no_ray_or_torch(module):
    assert heavy_modules_after(module) == []


def test_the_check_sees_heavy_imports():
    """The same check does see Ray when a module pulls it in."""
    assert "ray" in heavy_modules_after("dlrover_core.runtime.host")


@pytest.mark.parametrize("first", ["dlrover_core.plugins.manager",
                                   "dlrover_core.checkpoint.checkpointer",
                                   "dlrover_core.runtime.workload",
                                   "dlrover_core.builtin.plugin",
                                   "dlrover_core.master.job_master"])
def test_no_import_cycle(first):
    code = f"import {first}; import dlrover_core.plugins.hookspecs; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
