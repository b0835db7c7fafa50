"""``dlrover-run``'s command line before anything starts: user text printed as it is
(rich markup escaped) on every error path with exit 2, the default job name, multi-node
torchrun lines and ``PET_*`` variables, DLRover's flags, and ``--nproc-per-node gpu|auto``
counted on the cluster's nodes. No Ray starts here (the GPU count is given the nodes
Ray would list; the fake-GPU cluster run is tests/test_run_gpu.py)."""

from __future__ import annotations

import os
import signal

import pytest

from dlrover_core.cli import run as dlrover_run
from dlrover_core.runtime.script import visible_devices


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("PET_")] + ["RAY_ADDRESS"]:
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "x.py").write_text("")
    return tmp_path


def _spec(argv: list[str], nodes=None) -> dict:
    parser = dlrover_run.build_parser()
    args = parser.parse_args(argv)
    dlrover_run.check_options(parser, args)
    dlrover_run.meeting_place(parser, args)
    return dlrover_run.job_spec(args, nodes)


# ------------------------------------------------------------------- markup, exit 2
@pytest.mark.parametrize("argv,shown", [
    (["--log-dir", "[/logs]", "x.py"], "--log-dir='[/logs]'"),
    (["--rdzv-id", "[/x]", "x.py"], "'[/x]'"),
    (["--nnodes", "[/a]", "x.py"], "--nnodes='[/a]'"),
    (["--nproc-per-node", "[/n]", "x.py"], "--nproc-per-node='[/n]'"),
    (["--accelerator", "[/npu]", "x.py"], "--accelerator='[/npu]'"),
    (["--node-rank", "[/r]", "x.py"], "invalid int value: '[/r]'"),
    (["--master-addr", "[/h]", "x.py"], "'[/h]' as the place to meet"),
    (["--signals-to-handle", "[/SIG]", "x.py"], "'[/SIG]'"),
    (["--shutdown-timeout", "[/t]", "x.py"], "invalid int value: '[/t]'"),
    (["work/[exp]/train.py"], "work/[exp]/train.py"),
    (["-m", "[/x]"], "[/x]"),
])
def test_user_text_is_printed_as_it_is_and_exits_2(argv, shown, work, capsys):
    """Each error path prints the user's text with its brackets (rich would read
    ``[/x]`` as a closing tag: a MarkupError, exit 1; ``[exp]`` as a style: gone)."""
    assert dlrover_run.main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error:" in err and shown in err
    assert not (work / "runs").exists()  # nothing started


def test_busy_job_dir_with_markup_in_its_path_exits_3(work, capsys):
    from dlrover_core.master.dir_lock import DirLock

    job_dir = work / "[/jobs]"
    with DirLock(str(job_dir), "job directory", "busy"):
        assert dlrover_run.main(["--job-dir", str(job_dir), "x.py"]) == 3
    err = " ".join(capsys.readouterr().err.split())
    assert "[/jobs]" in err and "in use" in err


# ------------------------------------------------------------------- job name
def test_default_name_is_stable_and_names_the_script_or_module(work):
    (work / "a").mkdir()
    (work / "a" / "train.py").write_text("")
    (work / "b").mkdir()
    (work / "b" / "train.py").write_text("")
    (work / "pkg").mkdir()
    (work / "pkg" / "__init__.py").write_text("")
    (work / "pkg" / "mod.py").write_text("")
    first = _spec(["a/train.py"])["name"]
    assert first == _spec(["a/train.py", "--lr", "1"])["name"]  # a resubmit: same job
    assert first == _spec([str(work / "a" / "train.py")])["name"]  # however it is written
    assert first.startswith("train-") and first != _spec(["b/train.py"])["name"]
    mod = _spec(["-m", "pkg.mod"])["name"]
    assert mod.startswith("pkg.mod-") and mod == _spec(["-m", "pkg.mod"])["name"]
    assert _spec(["--rdzv-id", "exp1", "a/train.py"])["name"] == "exp1"


# ------------------------------------------------------------------- multi-node lines
def test_a_line_written_for_n_nodes_runs_once(work, capsys):
    """torchrun's multi-node forms: node rank 0 with an endpoint or master address is
    accepted (the ranks meet where dlrover says); other node ranks are refused with the
    advice to run the line once."""
    parser = dlrover_run.build_parser()
    for argv in (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "head:29400",
                  "--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=900", "x.py"],
                 ["--nnodes", "2", "--master-addr", "head", "--master-port", "29500",
                  "x.py"]):
        args = parser.parse_args(argv)
        dlrover_run.check_options(parser, args)
        assert dlrover_run.meeting_place(parser, args) == "head"
        assert dlrover_run.job_spec(args)["roles"]["trainer"]["total"] == 2
    local = parser.parse_args(["--rdzv-endpoint", "localhost:29400", "x.py"])
    assert dlrover_run.meeting_place(parser, local) is None
    standalone = parser.parse_args(["--standalone", "--rdzv-endpoint", "head:1", "x.py"])
    assert dlrover_run.meeting_place(parser, standalone) is None  # torchrun ignores it
    assert dlrover_run.main(["--nnodes", "2", "--node-rank", "1", "x.py"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--node-rank=1" in err and "run this line once" in err and "--address" in err


def test_pet_variables_as_torchrun_reads_them(work, monkeypatch, capsys):
    """A Kubeflow PyTorchJob's variables: ``PET_NNODES``/``PET_NPROC_PER_NODE`` are
    honoured, ``PET_MASTER_ADDR`` is the meeting place, ``PET_NODE_RANK`` other than 0 is
    refused naming the variable (the user typed no flag)."""
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MASTER_ADDR", "head-svc")
    monkeypatch.setenv("PET_MASTER_PORT", "23456")
    monkeypatch.setenv("PET_NODE_RANK", "0")
    parser = dlrover_run.build_parser()
    args = parser.parse_args(["x.py"])
    dlrover_run.check_options(parser, args)
    assert dlrover_run.meeting_place(parser, args) == "head-svc"
    role = dlrover_run.job_spec(args)["roles"]["trainer"]
    assert (role["total"], role["per_node"]) == (6, 3)
    monkeypatch.setenv("PET_NODE_RANK", "1")
    assert dlrover_run.main(["x.py"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--node-rank=1 (from the environment variable PET_NODE_RANK)" in err
    monkeypatch.setenv("PET_NODE_RANK", "0")
    assert dlrover_run.main(["x.py"]) == 2  # no --address: where is the Ray head?
    err = " ".join(capsys.readouterr().err.split())
    assert "'head-svc' as the place to meet" in err and "--address head-svc:6379" in err
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "rdzv-svc:29400")  # before PET_MASTER_ADDR
    args = dlrover_run.build_parser().parse_args(["--address", "auto", "x.py"])
    assert dlrover_run.meeting_place(parser, args) == "rdzv-svc"
    monkeypatch.setenv("PET_TEE", "3")
    assert dlrover_run.main(["x.py"]) == 2
    assert "PET_TEE" in capsys.readouterr().err


# ------------------------------------------------------------------- DLRover's flags
def test_dlrover_flags_mapped_or_refused_with_the_equivalent(work, capsys):
    for flag in (["--network-check"], ["--precheck", "1"], ["--comm-perf-test"],
                 ["--exclude-straggler"]):
        assert _spec(flag + ["x.py"])["node_health"] == {"skip_node_check": False}
    assert "node_health" not in _spec(["--save-at-breakpoint", "x.py"])
    fixed = _spec(["--nnodes", "4", "--node_unit", "2", "x.py"])
    assert fixed["roles"]["trainer"]["total"] == 4
    refused = {("--auto-config",): "--nproc-per-node gpu|auto",
               ("--auto_tunning",): "tuning.enabled",
               ("--accelerator", "ascend-npu"): "nvidia.com/gpu",
               ("--training-port", "60000"): "rendezvous port",
               ("--numa-affinity",): "os.sched_setaffinity",
               ("--node-unit", "3", "--nnodes", "4"): "divisor"}
    for flags, equivalent in refused.items():
        assert dlrover_run.main([*flags, "x.py"]) == 2, flags
        err = " ".join(capsys.readouterr().err.split())
        assert "cannot honour" in err and flags[0].replace("_", "-") in err \
            and equivalent in err, err


# ------------------------------------------------------------------- GPUs, signals
def test_gpu_ranks_counted_on_the_cluster_and_spread_over_nodes(work):
    """``gpu``/``auto`` count the cluster's nodes (the smallest GPU count), not this
    machine; each rank reserves one GPU; N node groups are spread over N nodes."""
    nodes = [{"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}, {"CPU": 4.0, "GPU": 0.0}]
    spec = _spec(["--nnodes", "2", "--nproc-per-node", "gpu", "x.py"], nodes)
    role = spec["roles"]["trainer"]
    assert (role["total"], role["resources"]["gpu"], spec["node_num"]) == (4, 1.0, 2)
    assert "per_node" not in role  # node_num spreads it: 2 per node on distinct nodes
    auto = _spec(["--nproc-per-node", "auto", "x.py"], nodes)["roles"]["trainer"]
    assert (auto["total"], auto["resources"]["gpu"]) == (2, 1.0)
    cpu = _spec(["--nproc-per-node", "auto", "x.py"], [{"CPU": 3.0, "GPU": 0.0}])
    assert (cpu["roles"]["trainer"]["total"], cpu["roles"]["trainer"]["resources"]["gpu"]) \
        == (3, 0.0)
    with pytest.raises(dlrover_run.UsageError, match="no node of the Ray cluster has a GPU"):
        _spec(["--nproc-per-node", "gpu", "x.py"], [{"CPU": 3.0, "GPU": 0.0}])


def test_visible_devices_put_the_ranks_gpu_at_local_rank():
    assert visible_devices(["2"], 1, ["0", "1", "2", "3"]) == "0,2,1,3"
    assert visible_devices([0], 0, ["0", "1"]) == "0,1"
    assert visible_devices(["5"], 1, ["4", "5"]) == "4,5"
    assert visible_devices(["1"], 3, ["0", "1"]) == "1"  # the node lists too few
    assert visible_devices([], 0, ["0"]) == ""


def test_signal_options():
    parser = dlrover_run.build_parser()
    args = parser.parse_args(["x.py"])
    assert dlrover_run.handled_signals(args) == [signal.SIGTERM, signal.SIGINT,
                                                 signal.SIGHUP, signal.SIGQUIT]
    assert dlrover_run.shutdown_timeout(args) == 30.0
    args = parser.parse_args(["--detach", "--signals-to-handle", "SIGINT,SIGUSR1",
                              "--shutdown-timeout", "2", "x.py"])
    assert dlrover_run.handled_signals(args) == [signal.SIGUSR1]
    assert dlrover_run.shutdown_timeout(args) == 2.0


# ------------------------------------------------------------------- niceness
def test_ranks_get_the_launchers_niceness_not_rays(work, monkeypatch):
    # Ray starts worker processes at niceness 15; torchrun's workers inherit torchrun's
    # (a run under nice 15 lost 0.91x torchrun's steps/s on a shared machine)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    env = _spec(["--nproc-per-node", "2", "x.py"])["roles"]["trainer"]["env"]
    assert env["RAY_worker_niceness"] == str(os.getpriority(os.PRIO_PROCESS, 0))
    monkeypatch.setattr(os, "getpriority", lambda which, who: 7)  # as under `nice -n 7`
    env = _spec(["x.py"])["roles"]["trainer"]["env"]
    assert env["RAY_worker_niceness"] == "7"
    monkeypatch.setenv("RAY_worker_niceness", "3")  # the user's own choice wins
    assert _spec(["x.py"])["roles"]["trainer"]["env"]["RAY_worker_niceness"] == "3"
