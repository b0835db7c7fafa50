"""``dlrover logs --address``: the ranks' attempt logs of a node that shares no file
system with the client.

A head and one worker node as separate ``ray start`` processes (``dlrover_core.cli.
local_cluster``); the worker node runs in a mount namespace of its own (``unshare
--mount``). After a 2-rank job ran on the worker node, its ``logs/`` directory is
covered, in the worker node's namespace only, by a tmpfs holding the ranks' logs, and
the client's copies of those files are deleted: this machine no longer has the ranks'
logs, the worker node still does, as a node without a shared file system would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from dlrover_core.cli import local_cluster as lc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DLROVER = [sys.executable, "-m", "dlrover_core.cli.main"]
PRIVATE_MOUNTS = ["unshare", "--mount", "--propagation", "private"]
TINY = ["config.n_layer=1", "config.n_embd=32", "config.n_head=2", "config.block_size=32",
        "config.batch_size=8", "config.eval_batches=1", "config.max_steps=6",
        "checkpoint.every_steps=4", "placement=spread", "node_health.skip_node_check=true"]


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    return subprocess.run([*PRIVATE_MOUNTS, "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare(),
                                reason="needs unshare --mount (root or CAP_SYS_ADMIN)")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(extra)
    return env


def _dlrover(*args: str, env: dict[str, str], timeout: float = 300):
    return subprocess.run([*DLROVER, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_logs_address_reads_ranks_of_a_node_without_shared_files(tmp_path):
    d = str(tmp_path / "cluster")
    state = lc.up(nodes=0, head_cpus=0, directory=d)
    try:
        worker = lc.add_node(state, num_cpus=2, wrap=PRIVATE_MOUNTS)
        auth = {k: v for k, v in lc.client_env(state).items() if k != "RAY_ADDRESS"}
        address = state["address"]
        job_dir = str(tmp_path / "job")
        sub = _dlrover("submit", "examples/nanogpt/job.yaml", "name=rlogs", *TINY,
                       "--job-dir", job_dir, "--no-progress", "--address", address,
                       env=_env(**auth))
        assert sub.returncode == 0, sub.stdout[-2000:] + sub.stderr[-3000:]
        logs = os.path.join(job_dir, "logs")
        ranks = sorted(n for n in os.listdir(logs) if n.startswith("trainer-"))
        assert ranks == ["trainer-0", "trainer-1"]
        with open(os.path.join(logs, "trainer-1", "attempt-0.log")) as f:
            rank1 = f.read()
        assert "rank" in rank1 and rank1.strip()
        # the worker node's namespace: a tmpfs over logs/ holding the ranks' logs only
        saved = str(tmp_path / "saved")
        for r in ranks:
            shutil.copytree(os.path.join(logs, r), os.path.join(saved, r))
        script = f"mount -t tmpfs tmpfs {logs} && cp -a {saved}/. {logs}/"
        cover = subprocess.run(["nsenter", "-t", str(worker["pid"]), "-m", "sh", "-c",
                                script], capture_output=True, text=True)
        assert cover.returncode == 0, cover.stderr
        shutil.rmtree(saved)
        for r in ranks:  # this machine's copies go; the directories stay (mount points)
            for name in os.listdir(os.path.join(logs, r)):
                os.remove(os.path.join(logs, r, name))

        local = _dlrover("logs", "rlogs", "--job-dir", job_dir, "--role", "trainer",
                         "--rank", "1", env=_env(**auth))
        assert local.returncode == 2 and "no worker logs" in local.stderr, local.stderr

        remote = _dlrover("logs", "rlogs", "--job-dir", job_dir, "--role", "trainer",
                          "--rank", "1", "--address", address, env=_env(**auth))
        assert remote.returncode == 0, remote.stderr[-3000:]
        body = remote.stdout.split("==> trainer-1 attempt 0 <==\n", 1)
        assert len(body) == 2, remote.stdout[-2000:]
        assert body[1].rstrip("\n") == rank1.rstrip("\n")

        every = _dlrover("logs", "rlogs", "--job-dir", job_dir, "--address", address,
                         env=_env(**auth))
        assert every.returncode == 0, every.stderr[-3000:]
        prefixes = {ln.split("]", 1)[0] + "]" for ln in every.stdout.splitlines()
                    if ln.startswith("[")}
        assert {"[trainer-0 a0]", "[trainer-1 a0]"} <= prefixes, prefixes
    finally:
        lc.down(d)
