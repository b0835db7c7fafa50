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


def test_cache_counts_hits_and_misses_per_split_and_id():
    c = EmbeddingCache()
    rows, missing = c.lookup("train", [3, 4, 5])
    assert rows == [None, None, None] and missing == [0, 1, 2]
    c.put("train", [3, 4, 5], torch.arange(6.0).reshape(3, 2))
    rows, missing = c.lookup("train", [5, 9, 3])
    assert missing == [1]
    assert rows[0].tolist() == [4.0, 5.0] and rows[2].tolist() == [0.0, 1.0]
    _, missing = c.lookup("test", [3])  # same id, other split: a miss
    assert missing == [0]
    assert (c.hits, c.misses, len(c)) == (2, 5, 3)
    with pytest.raises(ValueError, match="2 rows for 3 ids"):
        c.put("train", [1, 2, 3], torch.zeros(2, 2))


def test_persisted_cache_is_reloaded_and_a_corrupt_file_is_skipped(tmp_path):
    d = str(tmp_path / "cache")
    first = EmbeddingCache(d, "rank0-a0")
    first.put("train", [1, 2], torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    first.put("test", [1], torch.tensor([[5.0, 5.0]]))
    files = sorted(os.listdir(d))
    assert files == ["rank0-a0-000000.pt", "rank0-a0-000001.pt"]  # no temp files left
    again = EmbeddingCache(d, "rank0-a1")  # the replacement process
    assert (again.loaded, len(again), again.skipped_files) == (3, 3, 0)
    rows, missing = again.lookup("train", [2, 1])
    assert missing == [] and rows[0].tolist() == [0.0, 1.0]
    with open(os.path.join(d, files[1]), "r+b") as f:  # flip a byte of the payload
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    third = EmbeddingCache(d, "rank0-a2")
    assert (third.loaded, third.skipped_files) == (2, 1)
    assert third.lookup("test", [1])[1] == [0]  # the corrupt file's row is embedded again


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


def test_digits_captions_prompts_and_split():
    pytest.importorskip("sklearn")
    from examples.multimodal_clip_digits.data import CAPTIONS, PROMPT, DigitCaptions

    ds = DigitCaptions({})
    train, test = set(ds.sample_ids("train")), set(ds.sample_ids("test"))
    assert len(train) + len(test) == 1797 and not train & test
    assert len(test) == 359
    assert ds.load("image", "test", [0, 5]).shape == (2, 64)
    captions = ds.load("text", "train", sorted(train))
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    for i, c in zip(sorted(train), captions):  # each caption names its image's digit
        d = ds.label("train", i)
        assert c in {t.format(n=d, w=words[d]) for t in CAPTIONS}
    assert len(set(captions)) > 60  # several phrasings of every digit
    assert not any(c.startswith(PROMPT.split("{")[0]) for c in captions)  # never a prompt
    assert ds.load("text", "prompts", [3]) == ["a photo of the digit 3"]
