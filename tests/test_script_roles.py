"""Script roles: an unchanged torchrun script as a role (``roles.<role>.command``,
``DLJobBuilder.train``, ``dlrover-run``). Real Ray clusters, real child processes, real
gloo groups; the fault is a real SIGKILL of a rank's script process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover_core import DLJobBuilder, SpecError, load_spec
from dlrover_core.cli import run as dlrover_run
from dlrover_core.master.events import read_events
from dlrover_core.pids import pid_alive
from dlrover_core.testing import torchrun_script_pid
from tests.script_jobs import run_two_ranks

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "torchrun_ddp" / "train.py"
BIN = Path(sys.executable).parent
STEPS, SAVE_EVERY = 120, 40
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")

ENVDUMP = '''
import json, os, sys

import torch
import torch.distributed as dist

KEYS = %r


def main():
    code = int(sys.argv[sys.argv.index("--exit") + 1]) if "--exit" in sys.argv else 0
    dist.init_process_group("gloo")  # env:// from torchrun's variables
    t = torch.tensor([float(os.environ["RANK"]) + 1.0])
    dist.all_reduce(t)
    rec = {k: os.environ.get(k) for k in KEYS}
    rec.update(sum=t.item(), argv=sys.argv[1:], cwd=os.getcwd())
    with open("env-%%s.json" %% os.environ["RANK"], "w") as f:
        json.dump(rec, f)
    print("envdump rank", os.environ["RANK"], "exits", code, flush=True)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
''' % (TORCHRUN_ENV,)


def _events(job_dir, name):
    return [e for e in read_events(os.path.join(job_dir, "events.jsonl")) if e["event"] == name]


def _train_args(tmp: Path, tag: str, *extra: str) -> list[str]:
    return [str(EXAMPLE), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--snapshot", str(tmp / f"{tag}.pt"), "--out", str(tmp / f"{tag}.json"), *extra]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


# ---------------------------------------------------------------------- validation
def test_spec_errors_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "entry_mod.py").write_text("def main():\n    return 0\n")
    ok = load_spec({"name": "ok", "roles": {"trainer": {"command": "train.py --epochs 3",
                                                        "total": 2}}})
    assert ok.roles.trainer.backend == "torchrun"
    assert ok.roles.trainer.working_dir == str(tmp_path)
    yaml = tmp_path / "job.yaml"
    yaml.write_text("name: fn\nroles:\n  trainer: {command: 'entry_mod:main --lr 1', total: 2}\n")
    assert load_spec(str(yaml)).roles.trainer.workload.endswith(":ScriptWorkload")
    bad = {"missing.py": "no file 'missing.py'",
           "entry_mod:nope": "has no function 'nope'",
           "no_such_mod_xyz:main": "no module named 'no_such_mod_xyz'",
           "-m no_such_mod_xyz": "no module named 'no_such_mod_xyz'",
           "": "an empty command"}
    for command, why in bad.items():
        with pytest.raises(SpecError, match="roles.trainer.command") as info:
            DLJobBuilder().train(command).nproc_per_node(2).build()
        assert why in str(info.value)
    with pytest.raises(SpecError, match="roles.trainer.workload"):
        load_spec({"name": "x", "roles": {"trainer": {"command": "train.py",
                                                      "workload": "a.b:C"}}})
    with pytest.raises(SpecError, match="roles.trainer.backend"):
        load_spec({"name": "x", "roles": {"trainer": {"command": "train.py",
                                                      "backend": "fsdp"}}})
    # hang detection watches a script's ranks once they report steps (test_script_api)
    hang = DLJobBuilder().train("train.py").failover(hang_timeout_s=30).build()
    assert hang.spec.failover.hang_timeout_s == 30
    job = DLJobBuilder().train("train.py").nnodes(2).nproc_per_node(3).build()
    assert (job.spec.roles.trainer.total, job.spec.roles.trainer.per_node) == (6, 3)


@pytest.mark.parametrize("argv,flag", [
    (["--log-dir", "logs", "x.py"], "--log-dir"),
    (["--no-python", "x.py"], "--no-python"),
    (["--rdzv-backend", "etcd", "x.py"], "--rdzv-backend"),
    (["--tee", "3", "x.py"], "--tee"),
])
def test_dlrover_run_names_a_flag_it_cannot_honour(argv, flag, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert dlrover_run.main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot honour" in err and flag in err
    assert not (tmp_path / "runs").exists()  # nothing started


def test_dlrover_run_missing_script_is_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert dlrover_run.main(["--nproc_per_node", "2", "nope.py"]) == 2
    assert "no file 'nope.py'" in capsys.readouterr().err


def test_dlrover_run_exit_code_3_when_another_run_holds_the_job_dir(tmp_path, monkeypatch,
                                                                     capsys):
    """As ``dlrover submit``: exit 3, the error names the directory and its holder,
    nothing started (the lock is taken before Ray is)."""
    from dlrover_core.master.dir_lock import DirLock

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    job_dir = tmp_path / "job"
    with DirLock(str(job_dir), "job directory", "busy"):  # as a running submit holds it
        code = dlrover_run.main(["--nproc_per_node", "1", "--job-dir", str(job_dir), "x.py"])
    assert code == 3
    err = " ".join(capsys.readouterr().err.split())
    assert "job directory" in err and "in use" in err and "busy" in err
    assert not (job_dir / "summary.json").exists() and not (job_dir / "logs").exists()


# ---------------------------------------------------------------------- running
def test_builder_runs_function_with_torchrun_env(ray_cluster, tmp_path, monkeypatch):
    """``module:function`` through ``DLJobBuilder.train``: each rank gets torchrun's
    environment, joins a real gloo group with it, runs in the working directory, and
    its output reaches the rank's log file."""
    run_two_ranks(tmp_path, monkeypatch, "script-env", "envdump_mod.py", ENVDUMP,
                  "envdump_mod:main --flag x")
    recs = [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in (0, 1)]
    for rank, rec in enumerate(recs):
        assert all(rec[k] is not None for k in TORCHRUN_ENV), rec
        assert (rec["RANK"], rec["LOCAL_RANK"], rec["ROLE_RANK"]) == (str(rank),) * 3
        assert (rec["WORLD_SIZE"], rec["LOCAL_WORLD_SIZE"], rec["GROUP_RANK"]) == ("2", "2", "0")
        assert rec["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert rec["TORCHELASTIC_MAX_RESTARTS"] == "3"  # failover.max_restarts' default
        assert rec["TORCHELASTIC_RUN_ID"] == "script-env"
        assert rec["sum"] == 3.0  # 1 + 2: the all_reduce went through the script's group
        assert rec["argv"] == ["--flag", "x"] and rec["cwd"] == str(tmp_path)
    assert recs[0]["MASTER_PORT"] == recs[1]["MASTER_PORT"]
    log = (tmp_path / "job" / "logs" / "trainer-1" / "attempt-0.log").read_text()
    assert "envdump rank 1 exits 0" in log


@pytest.fixture(scope="module")
def torchrun_result(tmp_path_factory) -> dict:
    """The example under plain torchrun, 2 ranks, uninterrupted (run once per module)."""
    # torch 2.13's gloo aborts in interpreter teardown after a finished 2-rank script
    # in about 1 run of 10 ("terminate called without an active exception"; our runner
    # skips that teardown, see docs/torchrun.md): such a reference run is run again
    for _ in range(3):
        tmp = tmp_path_factory.mktemp("torchrun")
        res = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2",
                              *_train_args(tmp, "torchrun")], cwd=tmp, env=_env(),
                             capture_output=True, text=True, timeout=300)
        if res.returncode == 0 or "terminate called without an active exception" \
                not in res.stderr:
            break
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((tmp / "torchrun.json").read_text())


@pytest.mark.slow
def test_torchrun_and_dlrover_run_reach_the_same_loss(tmp_path, torchrun_result):
    """The example under torchrun and under dlrover-run: same final held-out loss."""
    ours = subprocess.run([str(BIN / "dlrover-run"), "--nproc_per_node", "2", "--job-dir",
                           str(tmp_path / "job"), *_train_args(tmp_path, "dlrover")],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0, ours.stdout[-3000:] + ours.stderr[-3000:]
    a = torchrun_result
    b = json.loads((tmp_path / "dlrover.json").read_text())
    assert a["steps"] == b["steps"] == STEPS and a["world_size"] == b["world_size"] == 2
    assert abs(a["final_loss"] - b["final_loss"]) < 1e-6, (a, b)
    assert a["final_loss"] < 3.0  # it learned something (uniform over ~100 chars: 4.6)


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["script", "actor"])
def test_sigkill_of_a_rank_restarts_the_group_and_resumes(tmp_path, torchrun_result, victim):
    """torchrun's semantics: rank 1's script (or the actor that runs it) is SIGKILLed
    after the first snapshot; the group's processes restart
    (``TORCHELASTIC_RESTART_COUNT`` 1) in the same placement group, resume from the
    script's own snapshot and end on the loss of a clean run. A killed actor takes its
    script with it (no orphan) and is replaced; a killed script's actor stays."""
    run_id = f"kill-{victim}-{os.getpid()}"
    job_dir = tmp_path / "job"
    proc = subprocess.Popen(
        [str(BIN / "dlrover-run"), "--nproc_per_node", "2", "--max-restarts", "1",
         "--rdzv-id", run_id, "--job-dir", str(job_dir), "--quiet",
         *_train_args(tmp_path, "killed", "--step-sleep", "0.05")],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        target = torchrun_script_pid(run_id, 1)
        deadline = time.time() + 120
        while not (tmp_path / "killed.pt").exists() and time.time() < deadline:
            time.sleep(0.05)
        script_pid = target
        if victim == "actor":
            target = _ppid(script_pid)  # the rank's WorkloadHost actor process
        os.kill(target, signal.SIGKILL)
        if victim == "actor":  # PR_SET_PDEATHSIG: the script goes with its actor
            deadline = time.time() + 10
            while pid_alive(script_pid) and time.time() < deadline:
                time.sleep(0.05)
            assert not pid_alive(script_pid), "the script outlived its killed actor"
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    res = json.loads((tmp_path / "killed.json").read_text())
    assert res["restart_count"] == 1 and res["resumed_from"] == SAVE_EVERY, res
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["restarts"]["process"] == 1 and summary["restarts"]["total"] == 1
    failed = _events(job_dir, "instance_failed")[0]
    if failed["rank"] == 1 and victim == "script":  # else rank 0 may have failed first
        assert failed["exc_type"].endswith("ScriptExitError")
        assert "SIGKILL" in failed["message"]
    if failed["rank"] == 1 and victim == "actor":
        assert failed["kind"] == "actor_died"
    rec = _events(job_dir, "recovery_finished")[0]
    assert rec["phases"]["survivor_abort"]["trainer-0"].startswith("script")
    started = _events(job_dir, "instance_started")
    pgs = {e["placement_group_id"] for e in started}
    assert len(pgs) == 1 and {e["attempt"] for e in started} == {0, 1}
    again = {e["rank"]: e for e in started if e["attempt"] == 1}
    first = {e["rank"]: e for e in started if e["attempt"] == 0}
    assert sorted(again) == [0, 1] and again[0]["in_place"]
    assert again[0]["pid"] == first[0]["pid"]
    if victim == "script":  # its actor outlived it: the group restarted in the same actors
        assert again[1]["in_place"] and again[1]["pid"] == first[1]["pid"]
    else:  # a new actor, in the same placement group (checked above)
        assert not again[1]["in_place"] and again[1]["pid"] != first[1]["pid"]
    log1 = (job_dir / "logs" / "trainer-1" / "attempt-1.log").read_text()
    assert "(restart count 1)" in log1 and f"resumed from step {SAVE_EVERY}" in log1
    # `dlrover logs` reads the script's output
    shown = subprocess.run([str(BIN / "dlrover"), "logs", run_id, "--job-dir", str(job_dir),
                            "--role", "trainer", "--rank", "0", "--attempt", "1"],
                           capture_output=True, text=True, timeout=60)
    assert "final held-out loss" in shown.stdout, shown.stdout + shown.stderr
    # the same final loss as an uninterrupted run (every random choice is per step;
    # --step-sleep changes no number)
    ref = torchrun_result
    assert abs(ref["final_loss"] - res["final_loss"]) < 1e-6, (ref, res)


@pytest.mark.slow  # a dlrover-run with its own Ray: ~10 s
def test_dlrover_run_exit_code_of_a_failing_script(tmp_path):
    """A script exiting 3 fails the job: dlrover-run exits with the job's exit code
    through ``dlrover submit``'s table (failed: 1, as torchrun), the summary's error
    names the script's exit code, and no restart was made (``--max-restarts``
    defaults to 0, as torchrun's)."""
    from dlrover_core.spec.builder import EXIT_CODES

    (tmp_path / "envdump.py").write_text(ENVDUMP)
    job_dir = tmp_path / "job"
    res = subprocess.run([str(BIN / "dlrover-run"), "--nproc_per_node", "2", "--job-dir",
                          str(job_dir), "--quiet", "envdump.py", "--exit", "3"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "exit code 3" in summary["error"]
    assert res.returncode == EXIT_CODES.get(summary["status"], 1)
    assert summary["restarts"]["total"] == 0
    assert (tmp_path / "env-0.json").exists() and (tmp_path / "env-1.json").exists()
