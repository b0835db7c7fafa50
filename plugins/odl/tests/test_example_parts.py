"""examples/odl_shuttle without a cluster: the dataset ships inside river (nothing is
downloaded), its time order, the stateless preprocessing, the offline baseline."""

from __future__ import annotations

import socket

import pytest
import torch

pytest.importorskip("river")

from examples.odl_shuttle.data import shuttle_records
from examples.odl_shuttle.run import offline_one_pass
from examples.odl_shuttle.workload import build_model, features


def test_shuttle_is_bundled_and_replayed_in_time_order(monkeypatch):
    def no_network(*a, **k):
        raise AssertionError("the dataset must not be downloaded")

    monkeypatch.setattr(socket, "create_connection", no_network)
    records = list(shuttle_records())
    assert len(records) == 49097
    assert [r["id"] for r in records[:3]] == [0, 1, 2]
    times = [r["x"][0] for r in records]           # f1 is time
    assert times == sorted(times) and times[0] < times[-1]
    assert sum(r["y"] for r in records) == 3511      # the anomalies
    assert next(iter(shuttle_records(5, order="file")))["x"][0] == 50.0  # the file's first row
    with pytest.raises(ValueError, match="allowed: time, file"):
        list(shuttle_records(5, order="random"))


def test_features_are_signed_log_and_the_model_gives_two_logits():
    x = features([[0.0, 1.0, -1.0, 99.0, -26739.0, 0.0, 0.0, 0.0, 0.0]])
    assert x.shape == (1, 9) and x.dtype == torch.float32
    assert x[0, 1] == pytest.approx(0.6931, abs=1e-4) and x[0, 2] == -x[0, 1]
    assert build_model()(x).shape == (1, 2)


def test_offline_baseline_learns_the_first_half():
    records = list(shuttle_records(4000, order="file"))
    acc, majority = offline_one_pass(records, lr=3e-3, hidden=32, batch_size=64)
    assert 0.5 < majority < 1.0
    assert acc > majority  # in file order the halves look alike, so one pass suffices
