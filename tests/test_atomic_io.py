"""Atomic, checksummed job-state files (the driver's state, summary.json)."""

from __future__ import annotations

import json
import os

import pytest

from dlrover_core.atomic_io import atomic_write_json, read_checksummed, write_checksummed


def test_checksummed_round_trip_and_corruption(tmp_path):
    path = str(tmp_path / "driver" / "state.pkl")
    assert read_checksummed(path) is None  # nothing yet
    write_checksummed(path, b"payload\nwith a newline")
    assert read_checksummed(path) == b"payload\nwith a newline"
    write_checksummed(path, b"second")  # replaces atomically, no temp file left
    assert read_checksummed(path) == b"second"
    assert os.listdir(tmp_path / "driver") == ["state.pkl"]
    with open(path, "r+b") as f:  # flip one payload byte
        f.seek(-1, os.SEEK_END)
        f.write(b"X")
    with pytest.raises(ValueError, match="state.pkl: sha256 of the payload does not match"):
        read_checksummed(path)


def test_atomic_json(tmp_path):
    path = str(tmp_path / "summary.json")
    atomic_write_json(path, {"b": 1, "a": [1, 2]})
    assert json.load(open(path)) == {"a": [1, 2], "b": 1}
    assert os.listdir(tmp_path) == ["summary.json"]


def test_driver_state_uses_it(tmp_path):
    from dlrover_core.runtime.trainer import BaseTrainer, TrainerContext

    t = BaseTrainer(TrainerContext(job="j", role_groups={}, config={}, resources={},
                                   job_dir=str(tmp_path)))
    assert t.load_state() is None
    t.save_state({"it": 7})
    assert t.load_state() == {"it": 7}
    path = os.path.join(str(tmp_path), "driver", "state.pkl")
    assert read_checksummed(path) is not None  # the same checksummed format
    with open(path, "ab") as f:
        f.write(b"torn")
    assert t.load_state() is None  # corrupt: ignored with a warning
