"""The disk saver with ``checkpoint.dir`` given by URI (:mod:`dlrover_core.checkpoint.
storage`): ``file://`` (the local path), fsspec's ``memory://`` (a non-local store, one
process) and fsspec's ``local://`` (the non-local code path over the local file system,
so that two rank processes share the store: the upload/commit path with a real gloo
group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fsspec
import pytest
import torch

from dlrover_core.checkpoint import Checkpointer, SaverConfig, SaverContext
from dlrover_core.checkpoint.disk import DiskSaver
from dlrover_core.checkpoint.manifest import CheckpointLoadError
from dlrover_core.checkpoint.storage import RemoteSteps, filesystem, local_path

HERE = os.path.dirname(os.path.abspath(__file__))


def make(uri: str, keep: int = 3) -> Checkpointer:
    return Checkpointer(DiskSaver(SaverConfig(dir=uri, keep=keep), SaverContext()),
                        every_steps=1)


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                   b.state_dict().values()))


@pytest.fixture
def memory_uri(request):
    uri = f"memory://dlrover-test/{request.node.name}"
    yield uri
    fs, path = filesystem(uri)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_local_path_of_uris():
    assert local_path("/mnt/ck") == "/mnt/ck" and local_path("rel/ck") == "rel/ck"
    assert local_path("file:///mnt/ck") == "/mnt/ck"
    assert local_path("memory://b/ck") is None and local_path("s3://b/ck") is None
    with pytest.raises(ValueError, match="absolute path"):
        local_path("file://host/ck")
    with pytest.raises(ValueError, match="nosuchproto://x"):
        filesystem("nosuchproto://x")


def test_file_uri_is_the_local_path(tmp_path):
    ck = make(f"file://{tmp_path}/ck", keep=2)
    m = model(0)
    for step in (1, 2, 3):
        ck.save(step, model=m)
    assert sorted(os.listdir(tmp_path / "ck")) == ["latest", "step_00000002", "step_00000003"]
    m2 = model(1)
    assert not same(m, m2)
    assert ck.load(model=m2) == 3 and same(m, m2)


def test_memory_uri_round_trip_retention_and_commit_marker(memory_uri):
    ck = make(memory_uri, keep=2)
    m = model(0)
    for step in (1, 2, 3):
        ck.save(step, model=m)
    fs, root = filesystem(memory_uri)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(root, detail=False))
    assert names == ["latest", "step_00000002", "step_00000003"]
    assert fs.cat_file(f"{root}/latest") == b"3\n"
    manifest = json.loads(fs.cat_file(f"{root}/step_00000003/manifest.json"))
    assert manifest["step"] == 3 and ".metadata" in manifest["files"]
    # a step whose commit did not finish (files, no manifest) is not committed
    fs.pipe_file(f"{root}/step_00000009/__0_0.distcp", b"partial")
    assert ck.saver.committed_steps() == [2, 3]
    m2 = model(1)
    assert ck.load(model=m2) == 3 and same(m, m2)


def test_memory_uri_damaged_step_is_skipped_and_quarantined(memory_uri, caplog):
    ck = make(memory_uri)
    m_old, m_new = model(0), model(5)
    ck.save(2, model=m_old)
    ck.save(4, model=m_new)
    fs, root = filesystem(memory_uri)
    shard = next(p for p in fs.find(f"{root}/step_00000004") if p.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[-1] ^= 0xFF  # same size, other bytes: only the checksum can tell
    fs.pipe_file(shard, bytes(data))
    m2 = model(1)
    assert ck.load(model=m2) == 2 and same(m_old, m2)
    assert "skipping checkpoint step 4" in caplog.text
    assert ck.saver.committed_steps() == [2]
    assert fs.exists(f"{root}/step_00000004/manifest.json.corrupt")
    fs.rm_file(f"{root}/step_00000002/__0_0.distcp")
    with pytest.raises(CheckpointLoadError, match="is missing"):
        ck.load(model=model(1))


def test_two_ranks_save_to_a_shared_store_and_load(tmp_path):
    """Two rank processes (gloo): each stages its own shard locally and uploads it; rank
    0 commits. Then the step is loaded by two new rank processes."""
    uri = f"local://{tmp_path}/store"
    script = os.path.join(HERE, "uri_ckpt_rank.py")

    def run(mode: str) -> list[str]:
        store = str(tmp_path / f"pg-{mode}")  # the group's file store (no port to race for)
        procs = [subprocess.Popen([sys.executable, script, mode, uri, str(r), store],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, errs) in zip(procs, outs):
            assert p.returncode == 0, errs[-3000:]
        return [out.strip().splitlines()[-1] for out, _ in outs]

    assert run("save") == ["saved", "saved"]
    store = RemoteSteps(uri)
    assert store.committed_steps() == [5]
    files = json.loads(fsspec.open(f"{uri}/step_00000005/manifest.json").open().read())
    assert sorted(files["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert run("load") == ["loaded 5", "loaded 5"]
