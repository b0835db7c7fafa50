"""``dlrover cluster up`` (``local_cluster.up``) starts again a worker node whose ``ray
start`` ended before it joined: the first two worker starts are made to fail for real
(the process exits at once, as a ``ray start`` does when its raylet dies while starting;
CI on 2026-12-02 lost a node whose one retry failed too)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlrover_core.cli import local_cluster as lc


@pytest.mark.slow
def test_a_worker_node_that_ends_while_starting_is_started_again(tmp_path, monkeypatch,
                                                                  capsys):
    real, failed = lc._ray_start, []

    def first_worker_fails(args, env, log_path, wrap=None):
        if any(a.startswith("--address=") for a in args) and len(failed) < 2:
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
        assert len(failed) == 2
        workers = [n for n in lc.node_rows(state) if not n["head"]]
        assert len(workers) == 1 and workers[0]["alive"] and workers[0]["node_id"]
        assert lc.read_state(d)["nodes"][1]["node_id"] == workers[0]["node_id"]
        err = capsys.readouterr().err
        assert "injected: this start fails" in err and err.count("starting ['worker-1'] again") == 2
    finally:
        lc.down(d)


def test_the_node_table_is_read_past_a_raylet_notice_printed_after_it(monkeypatch):
    """Ray printed a raylet's notice ("... has been marked dead ... lagging heartbeats")
    after the node table of ``_node_table``'s child process on a busy machine (make test
    SLOW=1), and the parse of the last line failed the GCS restart test. The child's
    output is given here as Ray printed it then (the notice cannot be had on demand)."""
    rows = [{"NodeManagerPort": 1234, "Alive": True, "NodeID": "ab"}]
    seen = []

    def child(cmd, **kw):
        seen.append(cmd[-1])
        mark = cmd[-1].split("print(")[1].split(" + ")[0].strip("'\"")
        out = (f"{mark}{json.dumps(rows)}\n"
               "(raylet) The node with node id: ab has been marked dead because the detector "
               "has missed too many heartbeats from it. This can happen when a \n"
               "\t(2) raylet has lagging heartbeats due to slow network or busy workload.\n")
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(lc.subprocess, "run", child)
    assert lc._node_table({"address": "127.0.0.1:1", "token_path": "/nonexistent"}) == rows
    assert "log_to_driver=False" in seen[0]
