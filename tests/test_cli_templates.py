"""``dlrover templates list`` shows the roles of every template: the ppo template's by
name, the multimodal template's as its pattern (a trainer plus one encoder role per
modality, named by the job). Real command, real installed plugins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dlrover_core import SpecError, load_spec
from dlrover_core.testing import dlrover_json


def _roles(rows: list[dict], name: str) -> list[tuple[str, bool, bool]]:
    row = {r["name"]: r for r in rows}[name]
    return [(r["name"], r["required"], r["pattern"]) for r in row["roles"]]


def test_json_lists_ppo_roles_and_the_multimodal_pattern():
    rows = dlrover_json("templates", "list")
    assert _roles(rows, "ppo") == [("actor", True, False), ("critic", True, False),
                                   ("rollout", False, False), ("reference", False, False),
                                   ("reward", False, False)]
    assert _roles(rows, "multimodal") == [("trainer", True, False),
                                          ("<modality>_encoder", False, True)]
    for row in rows:
        assert row["roles"], f"template {row['name']} lists no roles"


def test_table_shows_the_pattern_with_dots():
    env = {**os.environ, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "templates", "list"],
                         capture_output=True, text=True, timeout=120, check=True, env=env).stdout
    cells: dict[str, str] = {}
    name = None
    for line in out.splitlines():  # a cell may fold over several lines of its row
        parts = [p.strip() for p in line.split("│")]
        if len(parts) < 4:
            continue
        if parts[1]:
            name, cells[parts[1]] = parts[1], parts[3]
        elif name is not None and parts[3]:
            cells[name] += " " + parts[3]
    assert cells["multimodal"] == "trainer*, <modality>_encoder..."
    assert cells["ppo"] == "actor*, critic*, rollout, reference, reward"


def test_the_pattern_is_named_where_a_role_is_missing():
    spec = {"name": "mm", "template": "multimodal",
            "roles": {"vision_encoder": {"workload": "a.b:C"}}}
    with pytest.raises(SpecError, match=r"roles.trainer: None .*template 'multimodal' requires "
                                        r"role 'trainer'.*allowed: roles of template "
                                        r"'multimodal': trainer, <modality>_encoder"):
        load_spec(spec)
