"""``FlashCheckpointCallback`` with a real ``transformers.Trainer`` (a tiny GPT-2 built
from a config, nothing downloaded), each run in its own Ray actor process: the second
run resumes from the first one's save in shared memory and ends where an
uninterrupted run ends, bit for bit."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch

from dlrover_plugin_flashckpt import shm
from dlrover_plugin_flashckpt.persister import finish_job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture
def job(ray_cluster):
    name = f"flashhf-{uuid.uuid4().hex[:8]}"
    yield name
    finish_job(name, timeout=30)
    assert not shm.list_segments("/dev/shm", shm.job_prefix(name))


def run(directory: str, job: str, max_steps: int, every_steps: int, kill_at: int = -1) -> dict:
    from dlrover_plugin_flashckpt.testing_workloads import hf_train

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


def test_trainer_killed_after_a_save_resumes_from_memory_and_ends_like_an_uninterrupted_run(
        job, tmp_path):
    first = run(str(tmp_path / "ref"), job, max_steps=6, every_steps=3)  # uninterrupted
    assert first["resumed_from"] is None and first["saves"] == [3, 6]
    assert first["committed"][-1] == 6
    assert not torch.equal(first["steps"][2]["model"]["lm_head.weight"],
                           first["steps"][-1]["model"]["lm_head.weight"])  # it trains

    d = str(tmp_path / "ckpt")
    with pytest.raises(ray.exceptions.RayError):  # SIGKILLed right after the save of step 3
        run(d, job, max_steps=6, every_steps=3, kill_at=3)
    resumed = run(d, job, max_steps=6, every_steps=3)
    assert resumed["resumed_from"] == 3 and resumed["source"] == "memory"
    same_state(resumed["begin"], first["steps"][2])  # the state saved at step 3
    assert [s["step"] for s in resumed["steps"]] == [4, 5, 6]  # only the missing steps
    same_state(resumed["steps"][-1], first["steps"][-1])  # same end, bit for bit
    assert resumed["saves"] == [6] and resumed["committed"][-1] == 6
