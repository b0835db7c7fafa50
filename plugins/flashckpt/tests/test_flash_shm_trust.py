"""Issue 28 item 8: a file planted in the shared-memory directory can neither be mapped
nor run code in the trainer. No Ray: the planted files are made by this test process
(the same user), so what is refused is the mode, the symlink and the pickle payload
(another user's file is refused by the same owner check, which needs a second user
this machine does not have)."""

from __future__ import annotations

import os
import pickle
import stat
import zlib

import numpy as np
import pytest
import torch

from dlrover_core.checkpoint.manifest import CheckpointLoadError
from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
from dlrover_plugin_flashckpt import hygiene, layout, shm, storage
from dlrover_plugin_flashckpt.meta import MetaFormatError, pack_meta, unpack_meta
from dlrover_plugin_flashckpt.saver import FlashSaver


@pytest.fixture
def shm_dir(tmp_path):
    """A private directory standing in for /dev/shm (same code paths, no shared names)."""
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


class _Payload:
    """Unpickling this creates the file ``path`` (as a planted payload would run code)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _saver(shm_dir: str, directory: str) -> FlashSaver:
    return FlashSaver(SaverConfig(dir=directory, keep=1, job="trust",
                                  options={"shm_dir": shm_dir}), SaverContext())


def test_created_buffer_is_owner_only_and_symlink_target_is_untouched(shm_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    path = os.path.join(shm_dir, "dlrflash-x")
    os.symlink(victim, path)
    with pytest.raises(shm.ShmTrustError, match="symbolic link"):
        shm.Segment.attach(path)
    seg = shm.Segment.create(path, 100, 100, {"job": "x"}, bytes(16), 0, 1)
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid() and victim.read_bytes() == b"keep me"
    seg.close()
    again = shm.Segment.attach(path)
    assert again is not None and again.ident() == {"job": "x"}
    again.close()


def test_planted_buffer_with_mode_0644_is_refused(shm_dir, tmp_path):
    s = _saver(shm_dir, str(tmp_path / "ckpt"))
    # a valid-looking buffer at the saver's own (predictable) name, readable by all
    seg = shm.Segment.create(s.paths[0], 100, 100, {"job": "trust", "dir": s.dir},
                             bytes(16), 0, 1)
    seg.close()
    os.chmod(s.paths[0], 0o644)
    with pytest.raises(shm.ShmTrustError, match=r"mode 0644, not 0600"):
        shm.Segment.attach(s.paths[0])
    with pytest.raises(shm.ShmTrustError, match=s.paths[0]):
        s.reserve(1024, wait=False).result()
    rows = hygiene.describe(shm_dir)
    assert [r["state"] for r in rows] == ["refused"] and "0644" in rows[0]["error"]
    assert hygiene.remove_stale(shm_dir, "") == [] and os.path.exists(s.paths[0])
    s.close()


@pytest.mark.parametrize("in_lineage", [True, False])
def test_planted_pickle_payload_in_a_buffer_is_never_unpickled(shm_dir, tmp_path, in_lineage):
    """A pickled meta block planted in a buffer. Named as a save of the directory's
    current lineage, the load tries it, refuses it and raises; without a lineage (a
    fresh folder) no buffer belongs to the directory and the load starts from nothing;
    neither unpickles it."""
    marker = tmp_path / "pwned"
    s = _saver(shm_dir, str(tmp_path / "ckpt"))
    blob = pickle.dumps({"step": 5, "rank": 0, "table": [], "skeleton": _Payload(str(marker))})
    if in_lineage:
        attempt = storage.make_attempt("", 1, "planted")
        storage.start_lineage(s.dir, attempt, None)
        blob += storage.attempt_trailer(attempt)
    seg = shm.Segment.create(s.paths[0], len(blob), 100, {"job": "trust", "dir": s.dir},
                             bytes(16), 0, 1)
    seg.write_meta(blob)
    h = seg.read_header()
    h.state, h.step, h.seq, h.meta_len, h.meta_crc = shm.READY, 5, 1, len(blob), zlib.crc32(blob)
    seg.write_header(h)
    seg.close()
    live = {"w": torch.zeros(3)}
    if in_lineage:
        # a buffer claims step 5 and cannot be read: the load says so instead of starting
        # from step 0 (issue 28, item 5), and never unpickles it
        with pytest.raises(CheckpointLoadError,
                           match="step 5: shared memory.*never unpickled"):
            s.load(live)
    else:
        assert s.load(live) is None and not live["w"].any()
    assert not marker.exists()
    with pytest.raises(MetaFormatError, match="never unpickled"):
        unpack_meta(blob)
    assert not marker.exists()
    s.close()


def test_meta_block_round_trips_the_values_of_a_state_dict():
    state = {"model": {"w": torch.ones(2)},
             "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                           "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0],
                                             "foreach": None, "eps": float("inf")}]},
             "rng": {"python": (3, tuple(range(5)), None), "numpy": ("MT19937",
                                                                     np.arange(4, dtype=np.uint32),
                                                                     2, 0, 0.0)},
             "extra": {"pos": np.int64(17), "dtype": torch.bfloat16, "raw": b"\x00\x01",
                       "tags": {"a", "b"}, ("k", 1): "tuple key", "$odd": 1}}
    table, _, skeleton = layout.build_table(state)
    m = unpack_meta(pack_meta(7, table, skeleton, {"rank": 2, "world_size": 4}))
    assert (m["step"], m["rank"], m["world_size"], m["table"]) == (7, 2, 4, table)
    sk = m["skeleton"]
    assert sk["optimizer"]["param_groups"] == skeleton["optimizer"]["param_groups"]
    assert sk["optimizer"]["state"] == {0: {"step": layout.TensorRef(1)}}
    assert sk["rng"]["python"] == (3, (0, 1, 2, 3, 4), None)
    got = sk["rng"]["numpy"]
    assert got[0] == "MT19937" and got[1].dtype == np.uint32 and list(got[1]) == [0, 1, 2, 3]
    assert sk["extra"] == {"pos": 17, "dtype": torch.bfloat16, "raw": b"\x00\x01",
                           "tags": {"a", "b"}, ("k", 1): "tuple key", "$odd": 1}
    assert type(sk["extra"]["pos"]) is np.int64


def test_meta_block_refuses_functions_and_damage_and_never_creates_objects():
    with pytest.raises(TypeError, match=r"extra\.fn of type .*function"):
        pack_meta(0, [], {"extra": {"fn": lambda: 0}}, {})
    blob = bytearray(pack_meta(0, [], {"a": 1}, {}))
    blob[-2] ^= 0xFF
    with pytest.raises(MetaFormatError, match="crc32"):
        unpack_meta(bytes(blob))
    # a plain object (DeepSpeed's LossScaler) is saved as its attributes; a load sets
    # them on the live object of that type and never creates one
    saved = _Payload("/saved")
    m = unpack_meta(pack_meta(0, [], {"scaler": saved}, {}))
    live = {"scaler": _Payload("/live")}
    scaler = live["scaler"]
    layout.restore(live, m["skeleton"], [], None, "test")
    assert live["scaler"] is scaler and scaler.path == "/saved"
    with pytest.raises(layout.LayoutError, match="never creates one"):
        layout.restore({"scaler": None}, m["skeleton"], [], None, "test")
