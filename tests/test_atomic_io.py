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


@pytest.mark.parametrize("exchange", [True, False])
def test_replace_dir_swaps_a_directory_whole(tmp_path, monkeypatch, exchange):
    """A new directory replaces an old one: with RENAME_EXCHANGE in one step (the old
    one comes back at the source path), else through ``<dst>.replaced``; a crash
    between those two renames is recovered by putting the old copy back."""
    import dlrover_core.atomic_io as aio

    if not exchange:
        monkeypatch.setattr(aio, "_exchange", lambda a, b: False)
    dst, src = tmp_path / "step", tmp_path / ".step.tmp"
    dst.mkdir()
    (dst / "f").write_text("old")
    src.mkdir()
    (src / "f").write_text("new")
    old = aio.replace_dir(str(src), str(dst))
    assert (dst / "f").read_text() == "new"
    assert open(os.path.join(old, "f")).read() == "old"
    assert old == (str(src) if exchange else aio.aside_name(str(dst)))
    (tmp_path / "x").mkdir()
    assert aio.replace_dir(str(tmp_path / "x"), str(tmp_path / "x2")) is None  # plain move
    assert (tmp_path / "x2").is_dir() and not (tmp_path / "x").exists()


def test_replace_dir_crash_between_renames_keeps_the_old_copy(tmp_path, monkeypatch):
    import dlrover_core.atomic_io as aio

    monkeypatch.setattr(aio, "_exchange", lambda a, b: False)
    dst, src = tmp_path / "step", tmp_path / ".step.tmp"
    for p, text in ((dst, "old"), (src, "new")):
        p.mkdir()
        (p / "f").write_text(text)
    real = os.rename
    calls = []

    def rename(a, b):
        calls.append(a)
        if len(calls) >= 2:  # the process is gone: no rename after the first
            raise OSError("injected crash")
        return real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="injected crash"):
        aio.replace_dir(str(src), str(dst))
    monkeypatch.setattr(os, "rename", real)
    assert not dst.exists() and (tmp_path / "step.replaced" / "f").read_text() == "old"
    assert aio.recover_aside(str(dst))  # what committed_steps() and versions() run first
    assert (dst / "f").read_text() == "old" and (src / "f").read_text() == "new"


def test_write_all_writes_every_byte_of_short_writes(tmp_path):
    import io

    from dlrover_core.atomic_io import write_all

    class Short(io.FileIO):
        def write(self, b):
            return super().write(memoryview(b)[:3])

    path = str(tmp_path / "f")
    with Short(path, "w") as f:
        assert write_all(f, b"abcdefghij") == 10
    assert open(path, "rb").read() == b"abcdefghij"
