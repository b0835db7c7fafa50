"""``FlashCheckpointer.save`` in a script role reports each saved step to the JobMaster
(``checkpoint_saved``, as a workload's checkpointer does): the example
examples/torchrun_flashckpt/train.py (no dlrover import but ``FlashCheckpointer``) runs
under ``dlrover-run`` with 2 gloo ranks on the local Ray it starts; the job's events,
``summary.json`` and ``dlrover timeline`` hold its checkpoints. A second job on the same
checkpoint directory loads the persisted step, and ``FlashCheckpointer.load`` reports it
(``checkpoint_loaded``; the summary's ``resumed_from``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "torchrun_flashckpt" / "train.py"
BIN = Path(sys.executable).parent
STEPS, EVERY = 30, 10


def _run(tmp_path: Path, tag: str, steps: int) -> Path:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    job_dir = tmp_path / tag
    cmd = [str(BIN / "dlrover-run"), "--nproc_per_node", "2", "--rdzv-id",
           f"flash-reports-{tag}-{os.getpid()}", "--job-dir", str(job_dir), "--quiet",
           str(EXAMPLE), "--steps", str(steps), "--save-every", str(EVERY),
           "--persist-every", "1", "--ckpt-dir", str(tmp_path / "ckpt"),
           "--out", str(tmp_path / f"{tag}.json")]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return job_dir


@pytest.mark.slow
def test_saves_and_loads_are_checkpoint_events_of_the_job(tmp_path):
    from dlrover_core.cli.job_files import JobFiles
    from dlrover_core.cli.timeline_model import build_timeline

    files = JobFiles.read(str(_run(tmp_path, "first", STEPS)))
    saved = [(e["role"], e["step"]) for e in files.all("checkpoint_saved")]
    # the example saves every EVERY steps but not the last one
    assert saved == [("trainer", s) for s in range(EVERY, STEPS, EVERY)], saved
    assert all(e["blocking_s"] >= 0 for e in files.all("checkpoint_saved"))
    assert files.summary["checkpoint_steps"] == {"trainer": STEPS - EVERY}
    assert [c.step for c in build_timeline(files).checkpoints] == [s for _, s in saved]
    # a second job resumes from the persisted step; its load is reported
    files = JobFiles.read(str(_run(tmp_path, "second", STEPS + EVERY)))
    res = json.loads((tmp_path / "second.json").read_text())
    assert res["resumed_from"] == STEPS - EVERY and res["source"].startswith("disk"), res
    (loaded,) = files.all("checkpoint_loaded")
    assert (loaded["role"], loaded["step"], loaded["source"], loaded["attempt"]) == (
        "trainer", STEPS - EVERY, res["source"], 0)
    assert loaded["path"] == str(tmp_path / "ckpt" / f"step_{STEPS - EVERY:08d}")
    assert files.summary["resumed_from"]["trainer"]["step"] == STEPS - EVERY
    assert [e["step"] for e in files.all("checkpoint_saved")] == [STEPS]
