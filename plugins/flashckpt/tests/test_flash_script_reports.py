"""``FlashCheckpointer.save`` in a script role reports each saved step to the JobMaster
(``checkpoint_saved``, as a workload's checkpointer does): the example
examples/torchrun_flashckpt/train.py (no dlrover import but ``FlashCheckpointer``) runs
under ``dlrover-run`` with 2 gloo ranks on the local Ray it starts; the job's events,
``summary.json`` and ``dlrover timeline`` hold its checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "torchrun_flashckpt" / "train.py"
BIN = Path(sys.executable).parent
STEPS, EVERY = 30, 10


@pytest.mark.slow
def test_saves_are_checkpoint_events_of_the_job(tmp_path):
    from dlrover_core.cli.job_files import JobFiles
    from dlrover_core.cli.timeline_model import build_timeline

    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    job_dir = tmp_path / "job"
    cmd = [str(BIN / "dlrover-run"), "--nproc_per_node", "2", "--rdzv-id",
           f"flash-reports-{os.getpid()}", "--job-dir", str(job_dir), "--quiet",
           str(EXAMPLE), "--steps", str(STEPS), "--save-every", str(EVERY),
           "--persist-every", "1", "--ckpt-dir", str(tmp_path / "ckpt"),
           "--out", str(tmp_path / "out.json")]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    files = JobFiles.read(str(job_dir))
    saved = [(e["role"], e["step"]) for e in files.all("checkpoint_saved")]
    # the example saves every EVERY steps but not the last one
    assert saved == [("trainer", s) for s in range(EVERY, STEPS, EVERY)], saved
    assert all(e["blocking_s"] >= 0 for e in files.all("checkpoint_saved"))
    assert files.summary["checkpoint_steps"] == {"trainer": STEPS - EVERY}
    assert [c.step for c in build_timeline(files).checkpoints] == [s for _, s in saved]
