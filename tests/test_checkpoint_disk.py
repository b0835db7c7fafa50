"""The built-in disk saver: round trip, atomic commit, retention, corrupt steps skipped."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from dlrover_core.checkpoint import Checkpointer, SaverConfig, SaverContext
from dlrover_core.checkpoint.disk import DiskSaver
from dlrover_core.checkpoint.manifest import CheckpointLoadError, CorruptCheckpointError, verify
from dlrover_core.testing import crash_renames_after


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


def _params(m):
    return [p.detach().clone() for p in m.parameters()]


def test_damaged_step_is_quarantined_and_prune_keeps_the_step_just_saved(tmp_path):
    """A shard of the newest step is cut short from outside: the load falls back to
    the older step and renames the damaged one ``.corrupt``; a save below it with
    ``keep=1`` keeps the step it just saved."""
    ck = make(tmp_path)
    m, opt = model_and_opt(0)
    ck.save(2, model=m, optimizer=opt)
    ck.save(4, model=model_and_opt(4)[0], optimizer=opt)
    d = tmp_path / "ck"
    shard = next(p for p in (d / "step_00000004").iterdir() if p.suffix == ".distcp")
    os.truncate(shard, shard.stat().st_size // 2)
    m2, opt2 = model_and_opt(9)
    assert ck.load(model=m2, optimizer=opt2) == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(m), _params(m2)))
    assert (d / "step_00000004.corrupt").is_dir() and not (d / "step_00000004").exists()
    one = make(tmp_path, keep=1)
    one.save(3, model=m2, optimizer=opt2)
    assert one.saver.committed_steps() == [3]
    assert (d / "latest").read_text().strip() == "3"


def test_load_raises_when_committed_steps_exist_but_none_loads(tmp_path):
    """Every committed step lost a file (a prune racing the load, an NFS glitch):
    the load raises with each step tried and why, instead of returning None (which
    would restart training from step 0); the steps are not quarantined."""
    ck = make(tmp_path)
    m, opt = model_and_opt(0)
    for step in (2, 4):
        ck.save(step, model=m, optimizer=opt)
        shard = next(p for p in (tmp_path / "ck" / f"step_{step:08d}").iterdir()
                     if p.suffix == ".distcp")
        shard.unlink()
    m2, opt2 = model_and_opt(9)
    before = _params(m2)
    with pytest.raises(CheckpointLoadError) as e:
        ck.load(model=m2, optimizer=opt2)
    assert sorted(e.value.tried) == [2, 4]
    assert "step 4: CorruptCheckpointError" in str(e.value) and "is missing" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(m2)))
    assert ck.saver.committed_steps() == [2, 4]


@pytest.mark.parametrize("exchange", [True, False])
def test_resaving_a_step_never_leaves_it_missing(tmp_path, monkeypatch, exchange):
    """Step 4 is saved again (a restart from an older step reached it again). A crash
    is injected at each rename of the save (DCP's own, then the replacement's swap, or
    its two renames where the filesystem has no atomic exchange): afterwards step 4
    is always listed and verifies, holding the old or the new state."""
    m_old, opt = model_and_opt(0)
    m_new, _ = model_and_opt(5)
    outcomes = set()
    for crash_at in range(8):
        root = tmp_path / f"c{crash_at}"
        ck = make(root)
        ck.save(4, model=m_old, optimizer=opt)
        crash_renames_after(monkeypatch, crash_at, exchange)
        try:
            ck.save(4, model=m_new, optimizer=opt)
            crashed = False
        except BaseException as exc:  # DCP wraps it in CheckpointException(BaseException)
            if isinstance(exc, KeyboardInterrupt):
                raise
            crashed = True
        monkeypatch.undo()
        assert ck.saver.committed_steps() == [4], crash_at
        verify(str(root / "ck" / "step_00000004"))
        m2, opt2 = model_and_opt(9)
        assert ck.load(model=m2, optimizer=opt2) == 4
        got = [any(torch.equal(a, b) for a, b in zip(_params(w), _params(m2)))
               for w in (m_old, m_new)]
        assert got[0] != got[1] and (crashed or got[1]), crash_at  # whole old or new
        outcomes.add((crashed, got[1]))
    # crashes before the swap (old), after it (new), and a finished save (new)
    assert outcomes == {(True, False), (True, True), (False, True)}


def test_checkpointer_close_for_a_resetup_asks_the_saver_to_hand_on_what_it_can(tmp_path):
    """``Checkpointer.close(for_resetup=True)`` (a survivor's re-setup in place, from the
    WorkloadHost) calls the saver's ``close_for_resetup``; a plain close calls
    ``close``; the base class's ``close_for_resetup`` is a plain close (the disk saver's)."""
    calls = []

    class Recording(DiskSaver):
        def close(self):
            calls.append("close")

        def close_for_resetup(self):
            calls.append("close_for_resetup")

    cfg = SaverConfig(dir=str(tmp_path / "ck"))
    Checkpointer(Recording(cfg, SaverContext())).close(for_resetup=True)
    Checkpointer(Recording(cfg, SaverContext())).close()
    assert calls == ["close_for_resetup", "close"]

    class Plain(DiskSaver):
        def close(self):
            calls.append("plain close")

    Checkpointer(Plain(cfg, SaverContext())).close(for_resetup=True)
    assert calls[-1] == "plain close"
