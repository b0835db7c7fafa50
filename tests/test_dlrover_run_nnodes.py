"""``dlrover-run --nnodes``: torchrun's ``N`` and elastic ``MIN:MAX`` forms, parsed and
mapped onto the role's ``nodes`` range; a real run of ``--nnodes 1:2`` on a local Ray
(started by dlrover-run itself) reads the world size inside each rank's script.
The elastic shrink after a node loss: tests/test_script_node_loss.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlrover_core import load_spec
from dlrover_core.cli import run as dlrover_run

BIN = Path(sys.executable).parent

WORLD = '''
import json, os
import torch.distributed as dist

dist.init_process_group("gloo")
with open("world-%s.json" % os.environ["RANK"], "w") as f:
    json.dump({"world_size": dist.get_world_size(), "env": os.environ["WORLD_SIZE"],
               "group": int(os.environ["GROUP_WORLD_SIZE"]),
               "local": int(os.environ["LOCAL_WORLD_SIZE"])}, f)
dist.destroy_process_group()
'''


@pytest.mark.parametrize("value,expected", [("2", (2, 2)), ("2:2", (2, 2)),
                                            ("1:3", (1, 3)), (" 1 : 2 ", (1, 2))])
def test_parse_nnodes(value, expected):
    assert dlrover_run.parse_nnodes(value) == expected


@pytest.mark.parametrize("value", ["2:1", "0", "0:2", "a", "1:", ":2", "1:2:3", "1.5"])
def test_parse_nnodes_refuses(value):
    with pytest.raises(dlrover_run.UsageError) as err:
        dlrover_run.parse_nnodes(value)
    msg = str(err.value)
    assert "--nnodes" in msg and repr(value) in msg and "MIN:MAX" in msg


def _spec(argv: list[str]) -> dict:
    parser = dlrover_run.build_parser()
    args = parser.parse_args(argv)
    dlrover_run.check_options(parser, args)
    return dlrover_run.job_spec(args)


def test_elastic_range_maps_onto_the_role_nodes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    d = _spec(["--nnodes", "1:3", "--nproc-per-node", "2", "x.py"])
    role = d["roles"]["trainer"]
    assert (role["nodes"], role["total"], role["per_node"]) == ("1:3", 6, 2)
    spec = load_spec(d)  # a valid elastic script role
    assert spec.roles.trainer.nodes == "1:3" and spec.roles.trainer.backend == "torchrun"
    fixed = _spec(["--nnodes", "2:2", "--nproc-per-node", "2", "x.py"])["roles"]["trainer"]
    assert "nodes" not in fixed and fixed["total"] == 4


def test_bad_nnodes_is_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert dlrover_run.main(["--nnodes", "3:1", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "--nnodes='3:1'" in err and "MIN <= MAX" in err
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.slow
def test_dlrover_run_elastic_nnodes_starts_at_max(tmp_path):
    """``--nnodes 1:2 --nproc-per-node 1`` on this machine (an embedded Ray: each node-slot
    is a rank's CPUs here) starts at the maximum, 2 ranks, and records the size."""
    (tmp_path / "world.py").write_text(WORLD)
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    job_dir = tmp_path / "job"
    res = subprocess.run([str(BIN / "dlrover-run"), "--nnodes", "1:2", "--nproc-per-node", "1",
                          "--cpus-per-rank", "0.5", "--job-dir", str(job_dir), "--quiet",
                          "world.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"world-{rank}.json").read_text())
        assert (seen["world_size"], seen["env"]) == (2, "2")
        # one machine: both node-slots may share it (then LOCAL_WORLD_SIZE 2, GROUP 1)
        assert seen["group"] * seen["local"] == 2
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "succeeded"
    assert summary["world_sizes"] == [{"role": "trainer", "world_size": 2, "step": -1,
                                       "reason": "start", "checkpoint_step": None}]
