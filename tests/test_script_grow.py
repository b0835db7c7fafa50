"""An elastic script role grows back: 2 ranks on 2 worker nodes of a
``ray.cluster_utils.Cluster`` (its own Ray, in a subprocess:
``tests/scenarios/script_grow.py``); rank 1's node is removed (the role shrinks to 1
rank), a node is added, and at the script's next checkpoint report
(``dlrover_core.script_api.report_checkpoint``) the role restarts at 2 ranks, which
resume from that checkpoint and run to the last step."""

from __future__ import annotations

import itertools
import json

import pytest

from dlrover_core.cli.job_files import JobFiles
from tests.scenarios.script_grow import SAVE_EVERY, STEPS
from tests.scenarios import run_scenario


@pytest.mark.slow
def test_elastic_script_role_shrinks_and_grows_back(tmp_path):
    job_dir, work = tmp_path / "job", tmp_path / "work"
    res = run_scenario("script_grow", job_dir, work, timeout=600)
    summary = res["summary"]
    assert res["removed"] and res["added"] and res["room_at"], res
    assert summary is not None and summary["status"] == "succeeded", summary
    sizes = [(w["world_size"], w["reason"]) for w in summary["world_sizes"]]
    assert sizes == [(2, "start"), (1, "shrink"), (2, "grow")], summary["world_sizes"]
    grow = summary["world_sizes"][-1]
    # grown right after a checkpoint the 1-rank script reported after the room appeared
    assert grow["checkpoint_step"] % SAVE_EVERY == 0 and grow["checkpoint_step"] >= \
        2 * SAVE_EVERY, grow
    files = JobFiles.read(str(job_dir))
    room = files.all("elastic_room")
    assert room and room[0]["target"] == 2 and room[0]["world_size"] == 1
    assert grow["checkpoint_step"] > room[0]["after_checkpoint"]
    starts = [json.loads(line) for line in (work / "starts.jsonl").read_text().splitlines()]
    sizes0 = [k for k, _ in itertools.groupby(s["world_size"] for s in starts if s["rank"] == 0)]
    assert sizes0 == [2, 1, 2], starts  # (a survivor's restart before the shrink: 2, 2)
    grown = [s for s in starts if s["world_size"] == 2 and s["resumed_from"] > 0]
    assert sorted(s["rank"] for s in grown) == [0, 1]
    assert {s["resumed_from"] for s in grown} == {grow["checkpoint_step"]}
    final = json.loads((work / "out.json").read_text())
    assert (final["steps"], final["world_size"]) == (STEPS, 2)
    # the script's report_step calls: rank 0's steps reach metrics.jsonl to the last one
    assert summary["last_step"] == STEPS - 1
    assert {s["step"] for s in files.steps} == set(range(STEPS))
