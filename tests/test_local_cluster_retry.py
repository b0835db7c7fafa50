"""``dlrover cluster up`` (``local_cluster.up``) starts a worker node whose ``ray start``
ended before it joined once more: the first worker start is made to fail for real (its
process exits at once, as a ``ray start`` does when its raylet dies while starting)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dlrover_core.cli import local_cluster as lc


@pytest.mark.slow
def test_a_worker_node_that_ends_while_starting_is_started_again(tmp_path, monkeypatch,
                                                                  capsys):
    real, failed = lc._ray_start, []

    def first_worker_fails(args, env, log_path, wrap=None):
        if any(a.startswith("--address=") for a in args) and not failed:
            failed.append(args)
            with open(log_path, "ab") as log:
                return subprocess.Popen(
                    [sys.executable, "-c", "print('injected: this start fails'); exit(1)"],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return real(args, env, log_path, wrap)

    monkeypatch.setattr(lc, "_ray_start", first_worker_fails)
    d = str(tmp_path / "cluster")
    state = lc.up(nodes=1, cpus_per_node=1, directory=d)
    try:
        assert len(failed) == 1
        workers = [n for n in lc.node_rows(state) if not n["head"]]
        assert len(workers) == 1 and workers[0]["alive"] and workers[0]["node_id"]
        assert lc.read_state(d)["nodes"][1]["node_id"] == workers[0]["node_id"]
        err = capsys.readouterr().err
        assert "injected: this start fails" in err and "starting ['worker-1'] again" in err
    finally:
        lc.down(d)
