"""``dlrover plugin new``: every kind generates a package that installs, is listed by
``dlrover plugins list`` and passes its own tests as generated.

The slow test installs the six generated packages with pip (a real wheel build, not
editable) into a target directory that is put on ``PYTHONPATH``, rather than into the
shared ``.venv``: the effect for entry-point discovery is the same, and the venv other
test suites use is left unchanged.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib

import pytest

from dlrover_core.cli.main import main
from dlrover_core.cli.scaffold import ScaffoldError, core_requirement, new_plugin
from dlrover_core.cli.scaffold.kinds import KINDS
from dlrover_core.testing import dlrover_json

KIND_NAMES = ("backend", "template", "saver", "placement", "classifier", "tuner")


def test_all_six_kinds_exist():
    assert set(KINDS) == set(KIND_NAMES)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_generated_package_is_complete(kind, tmp_path):
    name = f"my-{kind}"
    root = new_plugin(name, kind, tmp_path)
    assert root == tmp_path / f"dlrover-plugin-{name}"
    pkg = f"dlrover_plugin_my_{kind}"
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert {"pyproject.toml", "README.md", f"{pkg}/__init__.py", f"{pkg}/plugin.py",
            "tests/conftest.py", "tests/test_listed.py"} <= files
    assert any(f.startswith("tests/test_my-") or f.startswith(f"tests/test_{name}")
               for f in files)
    for f in files:  # no placeholder left, every Python file parses
        text = (root / f).read_text()
        assert not re.search(r"__(NAME|PKG|DIST|CLASS|KIND|DEPS|SUMMARY|PROVIDES|HOOKS|"
                             r"LAYOUT|USAGE|CORE_REQ|NAME_ID)[A-Z_]*__", text), f
        if f.endswith(".py"):
            ast.parse(text, f)
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["name"] == f"dlrover-plugin-{name}"
    assert core_requirement() in meta["project"]["dependencies"]
    assert meta["project"]["entry-points"]["dlrover.plugins"] == {name: f"{pkg}.plugin"}
    assert "pytest>=8" in meta["project"]["optional-dependencies"]["test"]
    assert f"dlrover plugin new {name} --kind {kind}" in (root / "README.md").read_text()


def test_core_requirement():
    assert core_requirement("0.1.0") == "dlrover-core>=0.1,<0.2"
    assert core_requirement("1.4.2") == "dlrover-core>=1.4,<2"


def test_bad_input_is_refused_before_writing(tmp_path, capsys):
    with pytest.raises(ScaffoldError, match="plugin name 'My Plugin' is invalid"):
        new_plugin("My Plugin", "saver", tmp_path)
    with pytest.raises(ScaffoldError, match="--kind 'sink' is unknown; allowed: backend"):
        new_plugin("mine", "sink", tmp_path)
    assert list(tmp_path.iterdir()) == []
    new_plugin("mine", "saver", tmp_path)
    with pytest.raises(ScaffoldError, match="exists and is not empty"):
        new_plugin("mine", "saver", tmp_path)
    new_plugin("mine", "saver", tmp_path, force=True)
    # through the command: exit code 2 and the message
    assert main(["plugin", "new", "Bad!", "--kind", "saver", "--dir", str(tmp_path)]) == 2
    assert "plugin name 'Bad!' is invalid" in capsys.readouterr().err


def test_command_prints_what_it_wrote(tmp_path, capsys):
    assert main(["plugin", "new", "x1", "--kind", "classifier", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"created {tmp_path / 'dlrover-plugin-x1'}/" in out
    assert "dlrover_plugin_x1/plugin.py" in out
    # the hint names the interpreter that runs dlrover (its venv), not a bare pip/python
    py = os.path.relpath(sys.executable)
    py = py if not py.startswith("..") else sys.executable
    assert f"next: {py} -m pip install -e " in out and f"&& {py} -m pytest -q " in out, out


@pytest.mark.slow
def test_each_kind_installs_is_listed_and_passes_its_tests(tmp_path):
    names = {kind: f"gen{kind}" for kind in KIND_NAMES}
    roots = [new_plugin(name, kind, tmp_path / "src") for kind, name in names.items()]
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), *map(str, roots)],
                   check=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    rows = {r["name"]: r for r in dlrover_json("plugins", "list", env=env)}
    for kind, name in names.items():
        assert rows[name]["status"] == "active", rows[name]["error"]
        assert rows[name]["distribution"] == f"dlrover-plugin-{name}"
        expected = [p.replace("__NAME__", name) for p in KINDS[kind].provides]
        assert rows[name]["provides"] == expected
    for root in roots:
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests"], cwd=root, env=env, capture_output=True, text=True,
                             timeout=900)
        assert res.returncode == 0, f"{root.name}:\n{res.stdout[-4000:]}\n{res.stderr[-2000:]}"
        assert re.search(r"\d+ passed", res.stdout)
