"""Runs of one job directory, with real jobs (one DDP rank over gloo, a few steps of
``tests.cli_workloads:Chatty``): every ``dlrover submit`` is a new run; it says where it
resumed from; a checkpoint already at ``config.max_steps`` is ``already_complete``
(exit 4); ``--fresh`` moves the old checkpoints aside; events, summary, timeline and
logs are per run."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import yaml

from dlrover_core.cli.job_files import AmbiguousJobError, JobFiles, find_job
from dlrover_core.cli.jobs_list import list_jobs
from dlrover_core.cli.main import main
from dlrover_core.cli.timeline_model import build_timeline
from dlrover_core.master.events import read_events
from dlrover_core.runs import list_runs, run_paths

SPEC = {"name": "runs-test",
        "roles": {"trainer": {"workload": "tests.cli_workloads:Chatty", "total": 1,
                              "backend": "ddp", "resources": {"cpu": 1}}},
        "checkpoint": {"saver": "disk", "every_steps": 2, "keep": 2},
        "node_health": {"skip_node_check": True},  # not about node health: no probe
        "config": {"max_steps": 4, "step_s": 0.05}}


def _submit(capsys, spec_file: str, job_dir: str, *extra: str) -> tuple[int, dict, str]:
    code = main(["submit", spec_file, "--job-dir", job_dir, "--no-progress", "--json",
                 *extra])
    out = capsys.readouterr()
    return code, json.loads(out.out), out.err


@pytest.fixture(scope="module")
def runs(ray_cluster, tmp_path_factory):
    """(job directory, spec file) for the tests below, which submit in order: 4 steps;
    6 steps (resumes at 4, after a pause); 6 steps again (nothing left: no run); 8 steps;
    8 again without the last summary (nothing left, found by the run); 6 steps with
    --fresh."""
    tmp = tmp_path_factory.mktemp("runs")
    spec_file = str(tmp / "job.yaml")
    with open(spec_file, "w") as f:
        yaml.safe_dump(SPEC, f)
    return str(tmp / "runs" / "job"), spec_file


@pytest.fixture(scope="module")
def results():
    """The summaries of runs 1 and 2, as the tests that submitted them saw them."""
    return []


def test_first_run_starts_fresh(runs, results, capsys):
    job_dir, spec_file = runs
    code, summary, err = _submit(capsys, spec_file, job_dir)
    assert code == 0, summary["error"]
    assert summary["run"] == 1 and summary["resumed_from"] is None
    assert summary["steps"] == 4 and "resumed" not in err
    results.append(summary)


def test_second_run_says_where_it_resumed(runs, results, capsys):
    job_dir, spec_file = runs
    time.sleep(3)  # a gap between the runs that no figure of run 2 may count
    code, summary, err = _submit(capsys, spec_file, job_dir, "config.max_steps=6")
    assert code == 0, summary["error"]
    step_dir = os.path.join(job_dir, "ckpt", "trainer", "step_00000004")
    assert summary["run"] == 2
    assert summary["resumed_from"] == {"trainer": {"step": 4, "source": "disk",
                                                   "path": step_dir}}
    assert f"run 2: trainer resumed from step 4 (disk, checkpoint {step_dir})" in err
    assert summary["steps"] == 6  # steps 4 and 5 trained: the job's step is 5
    results.append(summary)


def test_runs_have_their_own_events_summary_and_timeline(runs, results, capfd):
    job_dir, _ = runs
    first, second = results[:2]
    assert list_runs(job_dir) == [1, 2]
    one, two = run_paths(job_dir, 1), run_paths(job_dir, "latest")
    assert one.dir == os.path.join(job_dir, "run-1") and two.dir == job_dir
    assert json.load(open(one.summary)) == first
    assert json.load(open(two.summary)) == second
    for paths, run in ((one, 1), (two, 2)):
        started = [e for e in read_events(paths.events) if e["event"] == "job_started"]
        assert [e["run"] for e in started] == [run]  # one run per events.jsonl
    loaded = [e for e in read_events(two.events) if e["event"] == "checkpoint_loaded"]
    assert [(e["role"], e["step"], e["source"]) for e in loaded] == [("trainer", 4, "disk")]
    # the timeline of run 2 starts after run 1 ended: the pause is in neither
    files = JobFiles.read(job_dir)
    assert files.run == 2 and files.first("job_started")["ts"] >= first["ended_at"]
    tl2 = build_timeline(files)
    assert tl2.wall_s <= second["wall_s"] + 1.0 and tl2.goodput == second["goodput"]
    assert main(["timeline", "runs-test", "--job-dir", job_dir, "--run", "1", "--json"]) == 0
    tl1 = json.loads(capfd.readouterr().out)
    assert tl1["run"] == 1 and tl1["wall_s"] <= first["wall_s"] + 1.0
    assert main(["status", "runs-test", "--job-dir", job_dir, "--run", "run-1",
                 "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["summary"] == first
    assert main(["timeline", "runs-test", "--job-dir", job_dir, "--run", "7"]) == 2
    with pytest.raises(FileNotFoundError, match="no run 7; its runs: 1, 2"):
        run_paths(job_dir, 7)
    with pytest.raises(SystemExit) as e:  # a usage error, before anything is read
        main(["logs", "runs-test", "--job-dir", job_dir, "--run", "second"])
    assert e.value.code == 2


def test_logs_are_per_run_with_a_header(runs, capsys):
    job_dir, _ = runs
    assert main(["logs", "runs-test", "--job-dir", job_dir, "--run", "1"]) == 0
    out1 = capsys.readouterr().out
    assert out1.startswith("=== run 1 of runs-test (started ")
    assert "setup rank 0 attempt 0 from step 0" in out1
    assert "from step 4" not in out1 and "rank 0 step 3 loss" in out1
    assert main(["logs", "runs-test", "--job-dir", job_dir]) == 0
    out2 = capsys.readouterr().out
    assert out2.startswith("=== run 2 of runs-test (started ")
    assert "setup rank 0 attempt 0 from step 4" in out2
    assert "from step 0" not in out2 and "rank 0 step 3 loss" not in out2
    assert "rank 0 step 5 loss" in out2


def test_a_checkpoint_at_max_steps_is_already_complete(runs, results, capsys):
    """Decided from the checkpoint folder before Ray starts (issue 52 item 8: a resubmit
    of the demo took 17.7 s to say so): no run is started or numbered, and the job's
    actors never exist (no new events)."""
    job_dir, spec_file = runs
    events_before = open(os.path.join(job_dir, "events.jsonl")).read()
    code, summary, err = _submit(capsys, spec_file, job_dir, "config.max_steps=6")
    assert code == 4
    assert summary["status"] == "already_complete" and summary["run"] is None
    assert summary["decided"] == "from the checkpoints, before starting"
    assert summary["resumed_from"]["trainer"]["step"] == 6
    assert "config.max_steps=6" in summary["error"] and "--fresh" in summary["error"]
    assert "(no run started)" in err
    assert list_runs(job_dir) == [1, 2]
    assert open(os.path.join(job_dir, "events.jsonl")).read() == events_before
    # a checkpoint below max_steps is not complete: the run starts (and trains to 8)
    code, summary, _ = _submit(capsys, spec_file, job_dir, "config.max_steps=8")
    assert code == 0 and summary["run"] == 3 and summary["steps"] == 8, summary
    # the run that is already complete at its start still says so (the JobMaster decides)
    # without the last run's summary (lost: removed here) nothing is certain before the
    # start: the run starts, and the JobMaster finds it already complete
    os.remove(run_paths(job_dir).summary)
    code, summary, err = _submit(capsys, spec_file, job_dir, "config.max_steps=8")
    assert code == 4 and summary["status"] == "already_complete" and summary["run"] == 4
    assert "run 4: trainer resumed from step 8 (disk" in err


def test_fresh_moves_the_old_checkpoints_aside(runs, capsys):
    job_dir, spec_file = runs
    code, summary, err = _submit(capsys, spec_file, job_dir, "config.max_steps=6",
                                 "--fresh")
    assert code == 0, summary["error"]
    assert summary["run"] == 5 and summary["resumed_from"] is None
    assert summary["steps"] == 6 and "resumed" not in err
    kept = os.path.join(job_dir, "run-4", "ckpt", "trainer")
    assert sorted(os.listdir(kept)) == ["latest", "step_00000006", "step_00000008"]
    assert "step_00000006" in os.listdir(os.path.join(job_dir, "ckpt", "trainer"))
    assert list_runs(job_dir) == [1, 2, 3, 4, 5]


def test_one_rule_finds_a_job_and_says_when_it_is_ambiguous(runs, monkeypatch, capfd):
    """A name, a job directory's name or path; two directories of one job name are an
    error listing both, and two rows of `dlrover list`."""
    job_dir, _ = runs
    root = os.path.dirname(job_dir)
    other = os.path.join(root, "other")
    shutil.copytree(job_dir, other)  # a second directory holding job 'runs-test'
    monkeypatch.chdir(os.path.dirname(root))  # so that runs/ is the default root
    assert find_job("other").job_dir == other
    assert find_job(job_dir) == find_job("job")
    assert find_job("job").name == "runs-test"
    with pytest.raises(AmbiguousJobError) as e:
        find_job("runs-test")
    assert f"{job_dir} (job 'runs-test'); {other} (job 'runs-test')" in str(e.value)
    assert main(["logs", "runs-test"]) == 2
    assert main(["logs", "other", "--run", "1"]) == 0
    assert capfd.readouterr().out.startswith("=== run 1 of runs-test (started ")
    now = time.time()
    rows = list_jobs("runs", cluster=False, now=now)
    assert [(r["name"], r["job_dir"], r["run"]) for r in rows] == [
        ("runs-test", job_dir, 5), ("runs-test", other, 5)]
    info = json.load(open(os.path.join(job_dir, "run.json")))
    assert rows[0]["started_at"] == json.load(open(os.path.join(job_dir, "summary.json"))
                                              )["started_at"]
    assert rows[0]["age_s"] == round(now - rows[0]["started_at"], 1)
    assert info["run"] == 5 and info["name"] == "runs-test" and info["fresh"] is True
    assert rows[0]["status"] == "succeeded" and rows[0]["error"] is None
    shutil.rmtree(other)


def test_status_during_start_up_says_starting():
    from dlrover_core.cli.main import status_line

    st = {"name": "ng", "run": 2, "job_dir": "/r/ng", "state": "placing", "step": -1,
          "total_steps": 60, "elapsed_s": 3.2, "restarts": {"total": 0}, "metrics": {}}
    assert status_line(st) == "ng run 2 (/r/ng): starting (placing) elapsed 3 s"
    st.update(state="running", step=41, metrics={"loss": 1.5})
    assert status_line(st) == "ng run 2 (/r/ng): running step 41/60 elapsed 3 s restarts 0 loss=1.5"


@pytest.mark.slow  # three runs: ~8 s
def test_a_checkpoint_uri_saves_to_the_store_resumes_and_refuses_fresh(ray_cluster, tmp_path,
                                                                       capsys, monkeypatch):
    """``checkpoint.dir`` as a URI of a non-local fsspec protocol (``local://``: fsspec's
    local file system under its own scheme, which the savers treat as a remote store):
    the steps are committed in the store (no folder named after the URI appears in the
    current directory), the second run resumes from it, and ``--fresh`` is refused before
    anything starts, naming the key and what is allowed."""
    import fsspec

    monkeypatch.chdir(tmp_path)
    store = f"local://{tmp_path}/store"
    spec = dict(SPEC, name="runs-uri-test",
                checkpoint=dict(SPEC["checkpoint"], dir=store))
    spec_file = str(tmp_path / "job.yaml")
    with open(spec_file, "w") as f:
        yaml.safe_dump(spec, f)
    job_dir = str(tmp_path / "job")
    code, summary, _ = _submit(capsys, spec_file, job_dir)
    assert code == 0, summary["error"]
    fs = fsspec.filesystem("local")
    assert fs.exists(f"{tmp_path}/store/trainer/step_00000004/manifest.json")
    assert not os.path.exists(tmp_path / "local:")
    code, summary, _ = _submit(capsys, spec_file, job_dir, "config.max_steps=6")
    assert code == 0, summary["error"]
    assert summary["resumed_from"]["trainer"]["step"] == 4
    assert summary["steps"] == 6
    code = main(["submit", spec_file, "--job-dir", job_dir, "--no-progress", "--json",
                 "--fresh"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"checkpoint.dir: '{store}' is invalid" in err and "--fresh" in err
    assert fs.exists(f"{tmp_path}/store/trainer/step_00000004/manifest.json")  # untouched
