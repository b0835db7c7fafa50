"""The built-in disk saver: round trip, atomic commit, retention, corrupt steps skipped."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from dlrover_core.checkpoint import Checkpointer, SaverConfig, SaverContext
from dlrover_core.checkpoint.disk import DiskSaver
from dlrover_core.checkpoint.manifest import CorruptCheckpointError, verify


def make(tmp_path, keep=3):
    return Checkpointer(DiskSaver(SaverConfig(dir=str(tmp_path / "ck"), keep=keep),
                                  SaverContext()), every_steps=2)


def model_and_opt(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    return m, opt


def test_round_trip_is_bit_exact(tmp_path):
    ck = make(tmp_path)
    m, opt = model_and_opt(0)
    extra = {"step": 7, "rng": torch.get_rng_state(), "data_pos": 1234}
    ck.save(7, model=m, optimizer=opt, extra=extra)
    m2, opt2 = model_and_opt(1)
    extra2 = {"step": 0, "rng": torch.zeros_like(extra["rng"]), "data_pos": 0}
    assert ck.load(model=m2, optimizer=opt2, extra=extra2) == 7
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for k in s1:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s1[k][name], s2[k][name])
    assert extra2["step"] == 7 and extra2["data_pos"] == 1234
    assert torch.equal(extra2["rng"], extra["rng"])


def test_no_checkpoint_returns_none(tmp_path):
    m, opt = model_and_opt(0)
    before = [p.clone() for p in m.parameters()]
    assert make(tmp_path).load(model=m, optimizer=opt) is None
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_commit_layout_and_retention(tmp_path):
    ck = make(tmp_path, keep=2)
    m, opt = model_and_opt(0)
    for step in range(1, 9):
        ck.maybe_save(step, model=m, optimizer=opt)
    d = tmp_path / "ck"
    assert sorted(os.listdir(d)) == ["latest", "step_00000006", "step_00000008"]
    assert (d / "latest").read_text().strip() == "8"
    manifest = verify(str(d / "step_00000008"))
    assert manifest["step"] == 8 and manifest["files"]
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())


def test_corrupt_and_partial_steps_are_skipped(tmp_path, caplog):
    ck = make(tmp_path)
    m, opt = model_and_opt(0)
    ck.save(2, model=m, optimizer=opt)
    m3, opt3 = model_and_opt(3)
    ck.save(4, model=m3, optimizer=opt3)
    d = tmp_path / "ck" / "step_00000004"
    shard = next(p for p in d.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum does not match"):
        verify(str(d))
    # a partial (uncommitted) temp dir of a newer step is ignored too
    (tmp_path / "ck" / ".step_00000006.tmp").mkdir()
    m2, opt2 = model_and_opt(9)
    with caplog.at_level(logging.WARNING):
        assert ck.load(model=m2, optimizer=opt2) == 2
    assert "skipping checkpoint step 4" in caplog.text
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
