"""``FlashCheckpointCallback`` with a real ``transformers.Trainer`` (a tiny GPT-2 built
from a config, nothing downloaded, dropout on), each run in its own Ray worker process:
a run SIGKILLed after a save is resumed by a new process from shared memory in the
middle of its second epoch; it trains the samples an uninterrupted run trains after
that step, in the same order, and ends with its weights, loss logs and
``training_loss``."""

from __future__ import annotations

import pytest
import ray
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def run(directory: str, job: str, max_steps: int, every_steps: int, kill_at: int = -1) -> dict:
    from plugins.flashckpt.tests.flash_workloads import hf_train

    task = ray.remote(num_cpus=0, max_retries=0)(hf_train)
    return ray.get(task.remote(directory, job, max_steps, every_steps, kill_at), timeout=600)


def same_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optimizer"].keys() == b["optimizer"].keys() and a["optimizer"]
    for k, v in a["optimizer"].items():
        assert (torch.equal(v, b["optimizer"][k]) if isinstance(v, torch.Tensor)
                else v == b["optimizer"][k]), k
    assert a["lr"] == b["lr"]


def test_trainer_killed_after_a_save_resumes_at_the_next_batch_like_an_uninterrupted_run(
        job, tmp_path):
    # 24 samples, 4 per optimizer step (2 x 2 accumulated): 6 steps an epoch, 10 in all
    first = run(str(tmp_path / "ref"), job, max_steps=10, every_steps=4)  # uninterrupted
    assert first["resumed_from"] is None and first["saves"] == [4, 8]
    assert first["committed"][-1] == 8
    seen = first["seen"]
    assert len(seen) == 40 and sorted(seen[:24]) == list(range(24))  # every sample once
    assert len(set(seen[24:])) == 16 and seen[24:40] != seen[:16]  # epoch 2 reshuffled
    assert not torch.equal(first["steps"][7]["model"]["lm_head.weight"],
                           first["steps"][-1]["model"]["lm_head.weight"])  # it trains

    d = str(tmp_path / "ckpt")
    with pytest.raises(ray.exceptions.RayError):  # SIGKILLed after step 9 (saved: 8)
        run(d, job, max_steps=10, every_steps=4, kill_at=9)
    resumed = run(d, job, max_steps=10, every_steps=4)
    assert resumed["resumed_from"] == 8 and resumed["source"] == "memory"
    same_state(resumed["begin"], first["steps"][7])  # the state saved at step 8
    assert [s["step"] for s in resumed["steps"]] == [9, 10]  # only the missing steps
    # the samples after step 8 (epoch 2, from its 5th batch): no repeat, no skip
    assert resumed["seen"] == seen[32:40]
    close_state(resumed["steps"][-1], first["steps"][-1])  # same end
    assert [s for s, _ in resumed["logs"]] == [3, 6, 9] == [s for s, _ in first["logs"]]
    for (_, a), (_, b) in zip(resumed["logs"], first["logs"]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)
    assert resumed["training_loss"] == pytest.approx(first["training_loss"], rel=1e-6,
                                                     abs=1e-9)
    assert resumed["saves"] == [] and resumed["committed"][-1] == 8


def close_state(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for k in a["model"]:
        torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-6, atol=1e-7,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert a["lr"] == pytest.approx(b["lr"])


def tiny_trainer(tmp_path, callbacks: list):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=1, vocab_size=16,
                                       n_positions=4))
    ids = torch.arange(4)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids}],
                   callbacks=callbacks)


def test_trainer_train_alone_and_resume_from_checkpoint_are_refused(tmp_path):
    from dlrover_plugin_flashckpt.hf import FlashCheckpointCallback

    flash = FlashCheckpointCallback(str(tmp_path / "ckpt"), every_steps=1)
    trainer = tiny_trainer(tmp_path, [flash])
    with pytest.raises(RuntimeError, match=r"callback\.train\(trainer\), not trainer\.train"):
        trainer.train()  # no step trained, nothing saved: it stops at on_train_begin
    assert trainer.state.global_step == 0 and flash.saves == []
    with pytest.raises(ValueError, match="resume_from_checkpoint is not allowed"):
        flash.train(trainer, resume_from_checkpoint=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="every_steps=0 is invalid"):
        FlashCheckpointCallback(str(tmp_path / "ckpt"), every_steps=0)
