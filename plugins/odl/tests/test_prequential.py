"""Prequential counters, baselines and kappas against values computed by hand, and
the trainer's test-then-train step (predict in eval mode, update in train mode)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from dlrover_plugin_odl.prequential import PrequentialStats
from dlrover_plugin_odl.workloads import prequential_step

# stream order; by hand (record 0 is a miss for both baselines, nothing seen yet):
#   model        ok  no  ok  ok  ok  no   -> 4/6
#   no-change    -   ok  ok  ok  no  ok   -> 4/6   (previous label 0 0 0 0 1)
#   majority     -   ok  ok  ok  no  no   -> 3/6   (majority so far 0 0 0 0 0)
#   labels 0:4 1:2, predictions 0:4 1:2 -> pc = (4*4 + 2*2) / 36 = 5/9
#   kappa = (4/6 - 5/9) / (1 - 5/9) = 1/4; kappa_temporal = (4/6 - 4/6) / (1/3) = 0
LABELS = [0, 0, 0, 0, 1, 1]
PREDICTIONS = [0, 1, 0, 0, 1, 0]


def test_baselines_and_kappas_match_the_hand_computed_values():
    s = PrequentialStats()
    s.update(LABELS, PREDICTIONS)
    m = s.metrics()
    assert m["prequential_accuracy"] == pytest.approx(4 / 6)
    assert m["baseline_no_change_accuracy"] == pytest.approx(4 / 6)
    assert m["baseline_majority_accuracy"] == pytest.approx(3 / 6)
    assert s.chance_agreement() == pytest.approx(5 / 9)
    assert m["kappa"] == pytest.approx(0.25)
    assert m["kappa_temporal"] == pytest.approx(0.0)


def test_majority_tie_goes_to_the_smallest_label_and_kappa_temporal_can_be_negative():
    # labels 1 0 0 1: majority predicts - 1 (1:1) 0 (tie 1:1,0:1 -> 0) 0 (0:2) -> 1/4
    # no-change: - 1!=0 0==0 0!=1 -> 1/4; model always right -> kappa_temporal 1
    s = PrequentialStats()
    s.update([1, 0, 0, 1], [1, 0, 0, 1])
    assert s.majority_accuracy() == pytest.approx(1 / 4)
    assert s.no_change_accuracy() == pytest.approx(1 / 4)
    assert s.kappa_temporal() == pytest.approx(1.0) and s.kappa() == pytest.approx(1.0)
    # a model that always answers 0 on a stream of runs: worse than no-change
    runs = PrequentialStats()
    runs.update([0, 0, 0, 1, 1, 1], [0] * 6)
    # p0 = 3/6, p_nc = 4/6 -> (1/2 - 2/3) / (1/3) = -1/2; pc = 3*6/36 = 1/2 -> kappa 0
    assert runs.kappa_temporal() == pytest.approx(-0.5)
    assert runs.kappa() == pytest.approx(0.0)


def test_chunks_give_the_same_counters_as_one_pass_and_survive_json():
    whole = PrequentialStats()
    whole.update(LABELS, PREDICTIONS)
    chunked = PrequentialStats()
    for i in range(0, len(LABELS), 4):   # the no-change state crosses the chunk border
        state = json.loads(json.dumps(chunked.state()))   # a checkpoint in between
        chunked = PrequentialStats.from_state(state)
        chunked.update(LABELS[i:i + 4], PREDICTIONS[i:i + 4])
    assert chunked == whole


def _one_record_at_a_time(labels, predictions):
    """The counters by their definitions, record by record (the reference)."""
    seen, out = {}, {"correct": 0, "no_change": 0, "majority": 0}
    last = None
    for y, p in zip(labels, predictions):
        if seen:
            top = max(seen.values())
            out["majority"] += min(k for k, c in seen.items() if c == top) == y
        out["no_change"] += last == y
        out["correct"] += p == y
        seen[y] = seen.get(y, 0) + 1
        last = y
    return out


def test_counters_equal_the_record_by_record_definitions_on_random_streams():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n, classes = 1 + trial * 7, 1 + trial % 5   # ties are frequent with few records
        labels = torch.randint(classes, (n,), generator=gen).tolist()
        predictions = torch.randint(classes, (n,), generator=gen).tolist()
        stats = PrequentialStats()
        cut = n // 3
        stats.update(labels[:cut], predictions[:cut])
        stats = PrequentialStats.from_state(json.loads(json.dumps(stats.state())))
        stats.update(labels[cut:], predictions[cut:])
        want = _one_record_at_a_time(labels, predictions)
        assert (stats.correct, stats.no_change_correct, stats.majority_correct) == (
            want["correct"], want["no_change"], want["majority"]), trial
        assert stats.records == n and stats.last_label == labels[-1]
        assert stats.label_counts == {str(k): labels.count(k) for k in set(labels)}
        assert stats.prediction_counts == {str(k): predictions.count(k)
                                           for k in set(predictions)}


def test_undefined_kappas_are_nan_and_bad_input_is_refused():
    s = PrequentialStats()
    s.update([1, 1, 1], [1, 1, 1])     # chance agreement is 1: kappa undefined
    assert math.isnan(s.kappa()) and s.kappa_temporal() == pytest.approx(1.0)  # p_nc = 2/3
    s.update([1], [0])                 # now no-change is perfect after the first record ...
    s.no_change_correct = s.records    # ... and with it counting the first, undefined too
    assert math.isnan(s.kappa_temporal())
    assert PrequentialStats().metrics()["prequential_accuracy"] == 0.0
    with pytest.raises(ValueError, match="2 labels but 1 predictions"):
        s.update([0, 1], [0])


# ---------------------------------------------------------------------------- eval / train mode
class _Recorder(torch.nn.Module):
    """Linear, optional batch norm, dropout (p=0.9), linear; records the mode of each
    forward."""

    def __init__(self, batch_norm: bool):
        super().__init__()
        norm = [torch.nn.BatchNorm1d(64)] if batch_norm else []
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), *norm, torch.nn.Dropout(0.9),
                                       torch.nn.Linear(64, 3))
        self.modes: list[bool] = []

    def forward(self, x):
        self.modes.append(self.training)
        return self.net(x)


def _predict(model, batch):
    return model(batch["x"]).argmax(-1)


def _loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def _batch(n):
    return {"x": torch.randn(n, 8) * 3 + 1, "y": torch.randint(0, 3, (n,))}


def test_prediction_runs_with_dropout_off_and_the_update_with_it_on():
    torch.manual_seed(0)
    model = _Recorder(batch_norm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)   # the weights never change
    batch = _batch(256)
    first, _ = prequential_step(model, opt, batch, _predict, _loss)
    second, _ = prequential_step(model, opt, batch, _predict, _loss)
    # dropout off while predicting: the same weights give the same predictions ...
    assert torch.equal(first, second) and first.dtype == torch.int64 and first.shape == (256,)
    # ... which with dropout on they would not (0.9 of 64 units dropped)
    assert model.training                                 # left in train mode
    with torch.no_grad():
        assert not torch.equal(model(batch["x"]).argmax(-1), first)
    assert model.modes[:4] == [False, True, False, True]  # predict, update, predict, update


def test_batch_norm_predicts_from_running_statistics_and_updates_them_in_train_mode():
    torch.manual_seed(0)
    model = _Recorder(batch_norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    norm = model.net[1]
    prequential_step(model, opt, _batch(64), _predict, _loss)
    # the update ran in train mode: batch norm's running statistics moved
    assert not torch.allclose(norm.running_mean, torch.zeros(64))
    # a one-record chunk: batch norm in train mode cannot normalise a batch of 1
    # ("Expected more than 1 value per channel"); in eval mode it uses the running
    # statistics, so the prediction works (the update of a single record would not)
    single = _batch(1)
    model.eval()
    expected = _predict(model, single)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        prequential_step(model, opt, single, _predict, _loss)
    assert model.modes[-2:] == [False, True]              # predicted, then failed to update
    model.train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        _predict(model, single)
    assert expected.shape == (1,)


def test_an_empty_chunk_still_steps_with_a_zero_loss():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    predictions, loss = prequential_step(model, opt, None, _predict, _loss)
    assert predictions.numel() == 0 and float(loss.detach()) == 0.0
    assert torch.equal(model.weight, before) and model.weight.grad is not None
