"""Wheels: the core and the ppo plugin, built and installed (not editable) into a fresh
venv, work together as ``pip install dlrover-core dlrover-plugin-ppo`` would.

The fresh venv gets the two wheels with ``--no-deps`` and then every requirement of
their metadata except torch (and the dlrover distributions themselves) from the package
index: torch is several hundred MB and listing plugins does not need it (a plugin's
entry-point module imports nothing heavy, which is what this test also checks).
``scripts/build_dists.sh`` (``make dist``) builds all the distributions with
``twine check``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIPPED = re.compile(r"^(torch|dlrover-core|dlrover-plugin-[\w-]+)\b", re.I)


def requirements(wheel: Path) -> list[str]:
    """``Requires-Dist`` entries of a wheel without an extra marker."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [ln.split(":", 1)[1].strip() for ln in text.splitlines()
            if ln.startswith("Requires-Dist:")]
    return [r for r in reqs if "extra ==" not in r]


def build_wheel(src: Path, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir",
                    str(out), str(src)], check=True, capture_output=True, timeout=600)
    name = "dlrover_core" if src == ROOT else f"dlrover_plugin_{src.name}"
    (wheel,) = out.glob(f"{name}-*.whl")
    return wheel


@pytest.mark.slow
def test_core_and_ppo_wheels_in_a_fresh_venv(tmp_path):
    pytest.importorskip("build", reason="make dist installs `build`; pip install build")
    wheels = [build_wheel(ROOT, tmp_path / "dist"),
              build_wheel(ROOT / "plugins" / "ppo", tmp_path / "dist")]
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["--no-deps", *map(str, wheels)], check=True, timeout=600)
    deps = sorted({r for w in wheels for r in requirements(w) if not SKIPPED.match(r)})
    assert any(d.startswith("ray") for d in deps) and any(d.startswith("gymnasium")
                                                          for d in deps)
    subprocess.run(pip + deps, check=True, timeout=1200)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # not the checkout's sources: the installed wheels, run from elsewhere
    where = subprocess.run([str(py), "-c", "import dlrover_core, dlrover_plugin_ppo as p;"
                            "print(dlrover_core.__file__); print(p.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert all(str(env_dir) in line for line in where.stdout.split())
    out = subprocess.run([str(env_dir / "bin" / "dlrover"), "plugins", "list", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
                         timeout=300).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == {"builtin", "ppo"}
    assert rows["ppo"]["status"] == "active", rows["ppo"]["error"]
    assert rows["ppo"]["provides"] == ["template:grpo", "template:ppo"]
    assert rows["builtin"]["distribution"] == "dlrover-core"
    # the packaged hook reference and scaffold come with the wheel
    hooks = subprocess.run([str(env_dir / "bin" / "dlrover"), "hooks"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True, timeout=300).stdout
    assert hooks == (ROOT / "docs" / "hooks.md").read_text()
