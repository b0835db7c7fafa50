"""A rank under ``dlrover-run`` sees what it sees under ``torchrun``: the whole environment
compared key by key (the allowed differences listed and explained below), the process's
niceness and session, ``__file__``, ``sys.argv``, ``sys.path[0]``, the working
directory; its stdout on the launcher's stdout and its stderr on its stderr; no
``reduce_op`` FutureWarning at exit; ``@record`` writes the error file that the
failure's message is taken from; the same exit code. Real processes: one torchrun run
and one dlrover-run run (an embedded Ray), the same 2-rank gloo script, whose rank 1
raises after both ranks wrote what they saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# two real launches (torchrun, then dlrover-run with its Ray): ~16 s
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent

SCRIPT = '''
import json, os, sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    seen = {"env": dict(os.environ), "file": __file__, "argv": sys.argv,
            "path0": sys.path[0], "cwd": os.getcwd(), "sum": t.item(),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "session_leader": os.getsid(0) == os.getpid()}
    with open(os.path.join(sys.argv[1], "seen-%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(seen, f)
    # one write each: two ranks' print()s of several parts interleave (seen under torchrun)
    sys.stdout.write("OUT rank %s\\n" % os.environ["RANK"])
    sys.stdout.flush()
    sys.stderr.write("ERR rank %s\\n" % os.environ["RANK"])
    sys.stderr.flush()
    dist.barrier()
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom [/x] in rank 1")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''

#: keys only dlrover-run's ranks have, by prefix or name, and why
ONLY_DLROVER = {
    "DLROVER_": "dlrover's own: job, role, attempt, node id, torchrun's --role",
    "RAY_": "the Ray worker the rank's actor is (RAY_ADDRESS: so that a script can join "
            "the cluster, e.g. for flash checkpoints)",
    "SPT_NOENV": "Ray's setproctitle setting of its worker processes",
    "PYTHONPATH": "dlrover-run puts the current directory on the workers' path, so that "
                  "-m pkg.mod and imports resolve as in the shell",
}
#: keys both have with other values, and why
DIFFERENT = {
    "MASTER_ADDR": "rank 0's node address (torchrun --standalone: localhost)",
    "MASTER_PORT": "a free port, chosen per attempt by each launcher",
    "TORCHELASTIC_RUN_ID": "the job's name (torchrun --standalone: a random uuid)",
    "TORCHELASTIC_ERROR_FILE": "a file in the job directory (torchrun: a temporary folder)",
    # torch reads it in init_process_group (rendezvous._create_c10d_store): True makes
    # every rank a TCPStore client of a store the launcher hosts; False makes rank 0's
    # script host it. Under dlrover-run the value is always the truth about who hosts
    # the store at MASTER_ADDR:MASTER_PORT. True at the first start would need rank 0's
    # actor to import torch.distributed (1.0-1.2 s of CPU, 1.7-3.0 s wall here) and bind
    # the store before its script may start, on the critical path of every start; after
    # a restart the actor has imported it in the background while attempt 0 trained
    "TORCHELASTIC_USE_AGENT_STORE": "False at the first start (rank 0's script hosts the "
                                    "store), True after a restart (rank 0's actor hosts "
                                    "it, as torchrun's agent does); see the comment",
    "_": "the shell's last command, set by how the launcher was started",
}


def _launch(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith(("PET_", "TORCHELASTIC_"))] + ["RAY_ADDRESS"]:
        env.pop(key, None)
    if env.get("PYTHONBREAKPOINT", "").startswith("ray."):  # ray.init in this process
        del env["PYTHONBREAKPOINT"]  # (an earlier test) set it; a user's shell has not
    env["PWD"] = str(cwd)  # as a shell in that folder has it
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("parity")
    (work / "probe.py").write_text(SCRIPT)
    out = {}
    for tag, cmd in (("torchrun", [str(BIN / "torchrun"), "--standalone"]),
                     ("dlrover", [str(BIN / "dlrover-run"), "--job-dir", str(work / "job")])):
        (work / tag).mkdir()
        res = _launch(cmd + ["--nproc-per-node", "2", "probe.py", str(work / tag)], work)
        seen = {r: json.loads((work / tag / f"seen-{r}.json").read_text()) for r in (0, 1)}
        out[tag] = (res, seen)
    out["work"] = work
    return out


def test_the_environment_matches_torchruns_key_by_key(runs):
    for rank in (0, 1):
        ours = runs["dlrover"][1][rank]["env"]
        theirs = runs["torchrun"][1][rank]["env"]
        missing = sorted(set(theirs) - set(ours))
        assert not missing, f"rank {rank}: torchrun gives {missing}, dlrover-run does not"
        extra = sorted(k for k in set(ours) - set(theirs)
                       if not any(k.startswith(p) for p in ONLY_DLROVER))
        assert not extra, f"rank {rank}: only dlrover-run gives {extra}"
        differ = sorted(k for k in set(ours) & set(theirs)
                        if ours[k] != theirs[k] and k not in DIFFERENT)
        assert not differ, {k: (theirs[k], ours[k]) for k in differ}
        for key in ("ROLE_NAME", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                    "TORCHELASTIC_SIGNALS_TO_HANDLE", "LOCAL_RANK", "GROUP_WORLD_SIZE"):
            assert ours[key] == theirs[key], key
        assert "PYTHONBREAKPOINT" not in ours or not ours["PYTHONBREAKPOINT"].startswith("ray.")
        assert ours["TORCHELASTIC_ERROR_FILE"].startswith(str(runs["work"] / "job"))
        # the launcher's niceness, not Ray's 15 for its workers; a session of its own, as
        # torchrun starts each worker (in the session of the Ray processes, a rank ran at
        # 0.91x torchrun's steps/s on 2 cores: the kernel shares the CPU between sessions)
        for key in ("file", "argv", "path0", "cwd", "sum", "nice", "session_leader"):
            want = runs["torchrun"][1][rank][key]
            if key == "argv":  # the folder each launcher's script writes to
                want = want[:1] + [str(runs["work"] / "dlrover")]
            assert runs["dlrover"][1][rank][key] == want, key
        assert os.path.isabs(runs["dlrover"][1][rank]["file"])


def test_stdout_stderr_exit_code_and_the_error_file(runs):
    (theirs, _), (ours, _) = runs["torchrun"], runs["dlrover"]
    assert ours.returncode == theirs.returncode == 1, ours.stderr[-3000:]
    for res in (theirs, ours):
        assert "OUT rank 0" in res.stdout and "OUT rank 1" in res.stdout
        assert "ERR rank" not in res.stdout
        assert "ERR rank 0" in res.stderr and "ERR rank 1" in res.stderr
        assert "boom [/x] in rank 1" in res.stderr
    assert ours.stdout.splitlines() == sorted(ours.stdout.splitlines())  # only the ranks'
    assert "reduce_op" not in ours.stderr  # the runner's exit no longer reads it
    error_file = runs["work"] / "job" / "logs" / "trainer-1" / "attempt-0.error.json"
    recorded = json.loads(error_file.read_text())
    assert "boom [/x] in rank 1" in json.dumps(recorded)
    summary = json.loads((runs["work"] / "job" / "summary.json").read_text())
    assert "RuntimeError: boom [/x] in rank 1" in json.dumps(summary)
