"""Pieces that need no cluster: the cache, the row hand-off maths, the CLIP loss on
worked examples, and the digits example's data."""

from __future__ import annotations

import math
import os

import pytest
import torch

from dlrover_plugin_multimodal.cache import EmbeddingCache
from dlrover_plugin_multimodal.contrastive import clip_loss, zero_shot_predict
from dlrover_plugin_multimodal.handoff import EncodedRefs, chunk_bounds, concat_rows, take_rows


def test_cache_counts_hits_and_misses_per_key():
    c = EmbeddingCache()
    rows, missing = c.lookup(["id:train/3", "id:train/4", "id:train/5"])
    assert rows == [None, None, None] and missing == [0, 1, 2]
    c.put(["id:train/3", "id:train/4", "id:train/5"], torch.arange(6.0).reshape(3, 2))
    rows, missing = c.lookup(["id:train/5", "id:train/9", "id:train/3"])
    assert missing == [1]
    assert rows[0].tolist() == [4.0, 5.0] and rows[2].tolist() == [0.0, 1.0]
    _, missing = c.lookup(["id:test/3"])  # same id, other split: a miss
    assert missing == [0]
    assert (c.hits, c.misses, len(c)) == (2, 5, 3)
    with pytest.raises(ValueError, match="2 rows for 3 keys"):
        c.put(["a", "b", "c"], torch.zeros(2, 2))
    with pytest.raises(ValueError, match="keys must be str; got 7"):
        c.put([7], torch.zeros(1, 2))


def test_persisted_cache_is_reloaded_and_a_corrupt_file_is_skipped(tmp_path):
    d = str(tmp_path / "cache")
    first = EmbeddingCache(d, "rank0-a0")
    first.put(["text:one", "text:two"], torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    first.put(["id:test/1"], torch.tensor([[5.0, 5.0]]))
    files = sorted(os.listdir(d))
    assert files == ["rank0-a0-000000.pt", "rank0-a0-000001.pt"]  # no temp files left
    again = EmbeddingCache(d, "rank0-a1")  # the replacement process
    assert (again.loaded, len(again), again.skipped_files) == (3, 3, 0)
    rows, missing = again.lookup(["text:two", "text:one"])
    assert missing == [] and rows[0].tolist() == [0.0, 1.0]
    with open(os.path.join(d, files[1]), "r+b") as f:  # flip a byte of the payload
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    third = EmbeddingCache(d, "rank0-a2")
    assert (third.loaded, third.skipped_files) == (2, 1)
    assert third.lookup(["id:test/1"])[1] == [0]  # the corrupt file's row is embedded again


def test_text_encoder_runs_once_per_distinct_caption():
    """64 toy captions are 12 distinct strings (3 phrasings x 4 classes), plus 4 prompts:
    the network sees each distinct string once, within a batch and across batches."""
    from collections import Counter

    from dlrover_core.runtime.context import WorkerContext
    from dlrover_plugin_multimodal.toy import ToyPairs, ToyTextEncoder

    seen = Counter()

    class Counting(ToyTextEncoder):
        def forward(self, texts):
            seen.update(texts)
            return super().forward(texts)

    config = {"multimodal": {
        "data": {"dataset": "dlrover_plugin_multimodal.toy:ToyPairs",
                 "modalities": ["vec", "tag"]},
        "encoders": {"vision_encoder": {"modality": "vec", "trainable": True},
                     "text_encoder": {"modality": "tag", "persist_cache": False}}}}
    enc = Counting(WorkerContext(job="t", role="text_encoder", rank=0, world_size=1,
                                 local_rank=0, local_world_size=1, config=config))
    enc.setup()
    first = enc.embed("train", list(range(32)))
    second = enc.embed("train", list(range(32, 64)))
    enc.embed("prompts", [0, 1, 2, 3])
    captions = ToyPairs({}).load("tag", "train", list(range(64)))
    assert len(set(captions)) == 12
    assert set(seen) == set(captions) | {f"which is {c}" for c in range(4)}
    assert set(seen.values()) == {1}  # each distinct string through the network once
    assert enc.stats()["embedded"] == 16.0
    def rows(out):  # inline outside Ray; in the object store when this process runs Ray
        if "embeddings" in out:
            return out["embeddings"]
        import ray

        return ray.get(out["object"])["embeddings"]

    # samples with the same caption got the same row; every row is its caption's
    emb = torch.cat([rows(first), rows(second)])
    with torch.inference_mode():
        want = enc.module(captions)
    assert torch.equal(emb, want)


def test_chunk_bounds_and_overlap_of_encoder_and_trainer_shares():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    enc = EncodedRefs("text_encoder", "text", "embeddings", ("r0", "r1", "r2", "r3"),
                      tuple(chunk_bounds(10, 4)))
    # two trainer ranks: [0, 5) needs encoder ranks 0 and 1; [5, 10) needs 1, 2 and 3
    assert [enc.overlapping(a, b) for a, b in chunk_bounds(10, 2)] == [[0, 1], [1, 2, 3]]


def test_rows_of_tensors_lists_and_dicts():
    x = {"pixels": torch.arange(12).reshape(6, 2), "names": list("abcdef")}
    part = take_rows(x, 2, 4)
    assert part["pixels"].tolist() == [[4, 5], [6, 7]] and part["names"] == ["c", "d"]
    both = concat_rows([take_rows(x, 0, 1), part])
    assert both["pixels"][:, 0].tolist() == [0, 4, 6] and both["names"] == ["a", "c", "d"]


def test_clip_loss_worked_example():
    # two orthogonal pairs, unit scale (logit_scale 0): logits = cosine similarities
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    b = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    loss, m = clip_loss(a, b, torch.tensor(0.0))
    # each row: softmax over [1, 0] -> -log(e / (e + 1)); the same both ways
    assert float(loss) == pytest.approx(-math.log(math.e / (math.e + 1)))
    assert m["i2t_accuracy"] == 1.0 and m["temperature"] == pytest.approx(1.0)
    swapped, m = clip_loss(a, b.flip(0), torch.tensor(0.0))
    assert float(swapped) == pytest.approx(-math.log(1 / (math.e + 1)))
    assert m["i2t_accuracy"] == 0.0
    # the scale is clipped at 100 (CLIP): a huge logit_scale acts as 100
    big, _ = clip_loss(a, b.flip(0), torch.tensor(50.0))
    assert float(big) == pytest.approx(100.0, rel=1e-4)
    with pytest.raises(ValueError, match=r"\(2, 2\) and text features \(3, 2\)"):
        clip_loss(a, torch.zeros(3, 2), torch.tensor(0.0))


def test_zero_shot_predict_uses_cosine_not_length():
    images = torch.tensor([[10.0, 1.0], [0.1, 1.0]])
    classes = torch.tensor([[1.0, 0.0], [0.0, 100.0]])
    assert zero_shot_predict(images, classes).tolist() == [0, 1]


def test_prompt_ensemble_averages_unit_prompt_features_per_class():
    from dlrover_plugin_multimodal.contrastive import prompt_ensemble

    f = torch.tensor([[2.0, 0.0], [0.0, 5.0], [0.0, 1.0], [3.0, 4.0]])
    out = prompt_ensemble(f, torch.tensor([0, 0, 1, 1]), 2)
    # class 0: mean of (1, 0) and (0, 1), renormalised; class 1: of (0, 1) and (.6, .8)
    r = 1 / math.sqrt(2)
    assert out[0].tolist() == pytest.approx([r, r])
    assert out[1].tolist() == pytest.approx([0.3 / math.sqrt(0.09 + 0.81),
                                             0.9 / math.sqrt(0.09 + 0.81)])
    with pytest.raises(ValueError, match=r"classes \[2\] have no prompt"):
        prompt_ensemble(f, torch.tensor([0, 0, 1, 1]), 3)


def test_digits_split_holds_out_digits_7_to_9_from_training():
    pytest.importorskip("sklearn")
    from examples.multimodal_clip_digits.data import CAPTIONS, WORDS, DigitCaptions

    ds = DigitCaptions({})
    train, test = set(ds.sample_ids("train")), set(ds.sample_ids("test"))
    assert not train & test and len(test) == 359
    assert {ds.label("train", i) for i in train} == set(range(7))  # 7, 8, 9 unseen
    assert {ds.label("test", i) for i in test} == set(range(10))
    assert len(train) == sum(1 for i in range(1797)
                             if i not in test and int(ds.labels[i]) < 7)
    assert ds.load("image", "test", [0, 5]).shape == (2, 64)
    captions = ds.load("text", "train", sorted(train))
    for i, c in zip(sorted(train), captions):  # each caption names its image's digit
        d = ds.label("train", i)
        assert c in {t.format(n=d, w=WORDS[d]) for t in CAPTIONS}
    assert len(set(captions)) == 7 * len(CAPTIONS)
    prompts = ds.sample_ids("prompts")
    assert ds.load("text", "prompts", [3, 13]) == ["a photo of three",
                                                   "this is the figure 3"]
    assert sorted(ds.label("prompts", j) for j in prompts) == sorted(list(range(10)) * 5)
    with pytest.raises(ValueError, match=r"train_digits=\[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\]"):
        DigitCaptions({"train_digits": list(range(10))})


def test_digits_eval_prompts_share_no_word_pair_with_any_training_caption():
    pytest.importorskip("sklearn")
    from examples.multimodal_clip_digits.data import CAPTIONS, WORDS, DigitCaptions, word_pairs

    assert word_pairs("Seven, written by hand") == {("seven", "written"), ("written", "by"),
                                                   ("by", "hand")}
    ds = DigitCaptions({})
    # every caption the data could write, for every digit (not only the trained ones)
    trained = set().union(*(word_pairs(t.format(n=d, w=WORDS[d]))
                            for t in CAPTIONS for d in range(10)))
    prompts = ds.load("text", "prompts", ds.sample_ids("prompts"))
    assert len(set(prompts)) == len(prompts) == 50
    for p in prompts:
        assert len(word_pairs(p)) >= 2, p
        assert not word_pairs(p) & trained, (p, word_pairs(p) & trained)
    # the old single prompt fails it: "digit 3" is a caption, "of the" in another
    assert word_pairs("a photo of the digit 3") & trained == {("digit", "3"), ("of", "the")}
