"""Issue 28 item 9b: a job whose ``checkpoint.options.shm_dir`` is not ``/dev/shm`` has
its stale buffers swept, its buffers removed at the job's end and by ``dlrover delete``
in that directory, and nothing of it is looked for in ``/dev/shm``. A real persister on
a local Ray cluster; the saver runs in this pytest process (one rank); ``/dev/shm``
holds decoys that a sweep or clean-up there would remove."""

from __future__ import annotations

import json
import os
import uuid

import torch

from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
from dlrover_core.cli.main import main
from dlrover_plugin_flashckpt import hygiene, plugin, shm
from dlrover_plugin_flashckpt.persister import finish_job
from dlrover_plugin_flashckpt.saver import FlashSaver


def _buffer(path: str, ident: dict, stale: bool) -> str:
    """A flash buffer at ``path``; ``stale``: its writer is gone (the recorded start
    time is not this process's) and it belongs to another Ray session."""
    seg = shm.Segment.create(path, 100, 100, ident, bytes(16), 0, 1)
    if stale:
        h = seg.read_header()
        h.writer_start += 1
        seg.write_header(h)
    seg.close()
    return os.path.basename(path)


def test_a_custom_shm_dir_is_where_the_job_is_swept_and_cleaned(ray_cluster, tmp_path, capfd,
                                                                monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = f"flashdir-{uuid.uuid4().hex[:6]}"
    custom = tmp_path / "shm"
    custom.mkdir()
    job_dir = tmp_path / "runs" / name
    ckpt = str(job_dir / "ckpt")
    gone = {"job": f"gone-{name}", "session": "session_of_another_cluster", "dir": ckpt}
    stale_here = _buffer(os.path.join(custom, shm.slot_name(gone["job"], ckpt, 0, 0)), gone,
                         stale=True)
    stale_dev = _buffer(os.path.join("/dev/shm", shm.slot_name(gone["job"], ckpt, 1, 0)),
                        gone, stale=True)
    other = str(tmp_path / "elsewhere" / "ckpt")  # the same job name, another directory
    decoy = os.path.join("/dev/shm", shm.slot_name(name, other, 0, 0))
    _buffer(decoy, {"job": name, "dir": other, "session": hygiene.current_session(),
                    "run_id": ""}, stale=False)
    s = None
    try:
        s = FlashSaver(SaverConfig(dir=ckpt, keep=2, job=name, options={
            "shm_dir": str(custom), "persist_every_steps": 100, "wait_timeout_s": 60,
            "reserve_mib": 1}), SaverContext(role="trainer"))
        import ray

        swept = ray.get(s.persister().ready.remote())["removed_stale"]
        assert stale_here in swept and stale_dev not in swept
        assert not os.path.exists(os.path.join(custom, stale_here))

        s.save(1, {"w": torch.ones(256)})
        s.save(2, {"w": torch.full((256,), 2.0)})  # not due: persisted by the job's end
        assert s.last_save["step"] == 2 and s.skipped == [], (s.last_save, s.skipped)
        ours = sorted(os.listdir(custom))
        assert ours and all(n.startswith(shm.job_prefix(name)) for n in ours)
        s.close()
        summary: dict = {}
        events: list = []
        plugin.dlrover_job_finished(name, summary, lambda ev, **kw: events.append((ev, kw)), {
            "checkpoint": {"saver": "flash", "options": {"shm_dir": str(custom)}}})
        assert "checkpoint_not_persisted" not in summary and s.committed_steps() == [2], \
            (summary, events)
        assert os.listdir(custom) == [] and os.path.exists(decoy)

        # a buffer the job's end could not remove (its node's persister was gone)
        left = _buffer(os.path.join(custom, shm.slot_name(name, ckpt, 1, 0)),
                       {"job": name, "dir": ckpt}, stale=False)
        (job_dir / "run.json").write_text(json.dumps({"run": 1, "name": name,
                                                      "started_at": 1.0}))
        (job_dir / "summary.json").write_text(json.dumps({"name": name,
                                                          "status": "succeeded"}))
        assert main(["delete", name]) == 0
        out = " ".join(capfd.readouterr().out.split())
        assert os.listdir(custom) == [] and os.path.exists(decoy)
        assert f"removed flash-checkpoint buffer {custom / left}" in out
        assert hygiene.recorded_shm_dirs(name) == []
    finally:
        if s is not None:
            s.close()
        finish_job(name, timeout=30)
        for path in (decoy, os.path.join("/dev/shm", stale_dev)):
            if os.path.exists(path):
                os.unlink(path)
        hygiene.forget_shm_dirs(name)
