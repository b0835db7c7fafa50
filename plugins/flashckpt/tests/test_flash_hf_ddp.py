"""``FlashCheckpointCallback`` with ``transformers.Trainer`` over DDP: two ranks (gloo,
CPU) of a plain torchrun script (``hf_ddp_script.py``) under ``dlrover-run``. A run whose
ranks are SIGKILLed after step 4 (its save committed to disk) is resumed by a second
``dlrover-run`` (a new Ray cluster, a new job name for the shared-memory buffers, so only
the disk holds the save); it trains the samples an uninterrupted run trains after step 4
and ends on its weights, loss logs and ``training_loss``.

Run with another transformers release first on ``PYTHONPATH`` (a ``pip install
--target`` folder) to test that release: the script reports the version it ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "hf_ddp_script.py"
BIN = Path(sys.executable).parent
STEPS, EVERY, KILL_AT = 12, 2, 4  # 8 steps an epoch: the kill is inside the first epoch


def _env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # each dlrover-run starts its own cluster
    if env.get("PYTHONBREAKPOINT", "").startswith("ray."):  # an earlier test's ray.init
        del env["PYTHONBREAKPOINT"]
    return env


def _run(tmp: Path, tag: str, ckpt: Path, *extra: str) -> tuple[int, str]:
    cmd = [str(BIN / "dlrover-run"), "--nproc_per_node", "2", "--max-restarts", "0",
           "--rdzv-id", f"hf-{tag}-{os.getpid()}", "--job-dir", str(tmp / tag), "--quiet",
           str(SCRIPT), "--ckpt", str(ckpt), "--job", f"hf-{tag}-{os.getpid()}",
           "--out", str(tmp / f"{tag}.pt"), "--max-steps", str(STEPS), "--every", str(EVERY),
           *extra]
    proc = subprocess.run(cmd, cwd=tmp, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    return proc.returncode, proc.stdout[-4000:]


@pytest.mark.slow
def test_two_rank_trainer_killed_resumes_from_disk_like_an_uninterrupted_run(tmp_path):
    code, out = _run(tmp_path, "ref", tmp_path / "ref-ckpt")  # uninterrupted
    assert code == 0, out
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    assert ref["world_size"] == 2 and ref["resumed_from"] is None and ref["step"] == STEPS
    assert len(ref["seen"]) == 2 * STEPS  # rank 0: 2 samples a step, its half of each epoch
    assert len(set(ref["seen"][:16])) == 16  # no sample twice within an epoch on a rank

    ckpt = tmp_path / "ckpt"
    code, out = _run(tmp_path, "killed", ckpt, "--kill-at", str(KILL_AT))
    assert code != 0, out  # the ranks SIGKILLed themselves; no restart was allowed
    assert not (tmp_path / "killed.pt").exists()
    assert sorted(p.name for p in ckpt.glob("step_*"))[-1] == f"step_{KILL_AT:08d}"

    code, out = _run(tmp_path, "resumed", ckpt)  # a new job: memory has no save of it
    assert code == 0, out
    res = torch.load(tmp_path / "resumed.pt", weights_only=False)
    print(f"transformers {res['version']}")
    assert res["resumed_from"] == KILL_AT and res["source"] == "disk", res["source"]
    assert res["step"] == STEPS
    # the samples after step 4 on rank 0 (the rest of epoch 1, then epoch 2): no repeat
    # of a trained batch, no skipped one
    assert res["seen"] == ref["seen"][2 * KILL_AT:]
    assert res["model"].keys() == ref["model"].keys()
    for k in ref["model"]:
        torch.testing.assert_close(res["model"][k], ref["model"][k], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert [s for s, _ in res["logs"]] == [s for s, _ in ref["logs"]] == [3, 6, 9, 12]
    for (_, a), (_, b) in zip(res["logs"], ref["logs"]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)
    assert res["training_loss"] == pytest.approx(ref["training_loss"], rel=1e-6, abs=1e-9)
