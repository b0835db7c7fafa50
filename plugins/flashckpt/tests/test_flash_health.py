"""A persister that cannot persist shows in the job's health (``status()["health"]``,
``health_failing`` / ``health_recovered`` events): the real plugin manager with the
installed plugins, the real persister actor, its checkpoint folder on a real full
tmpfs that later gets its space back."""

from __future__ import annotations

import errno
import os
import time

import torch
from test_flash_commit import small_tmpfs  # noqa: F401 - a fixture

from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
from dlrover_core.master.health import HealthWatch
from dlrover_core.plugins.manager import PluginManager
from dlrover_plugin_flashckpt.saver import FlashSaver


def test_a_full_checkpoint_folder_shows_in_the_jobs_health(job, small_tmpfs):  # noqa: F811
    d = os.path.join(small_tmpfs, "ckpt")
    filler = os.path.join(small_tmpfs, "filler")
    with open(filler, "wb") as f:
        st = os.statvfs(small_tmpfs)
        f.write(b"\0" * (st.f_bavail * st.f_frsize - (64 << 10)))
    events: list[tuple[str, dict]] = []
    spec = {"checkpoint": {"saver": "flash", "dir": d}}
    watch = HealthWatch(PluginManager(), job, spec, lambda e, **f: events.append((e, f)))
    assert watch.poll() == {}
    s = FlashSaver(SaverConfig(dir=d, keep=2, job=job, options={"wait_timeout_s": 60}),
                   SaverContext())
    s.save(1, {"w": torch.arange(50_000, dtype=torch.float32)})  # 200 KB: does not fit
    deadline = time.monotonic() + 60
    while not watch.poll():
        assert time.monotonic() < deadline, "the job's health never said persisting fails"
        time.sleep(0.2)
    [(node, state)] = watch.current()["checkpoint_persist"].items()
    assert "step 1" in state["what"] and os.strerror(errno.ENOSPC) in state["error"]
    assert [e for e, _ in events] == ["health_failing"]
    os.unlink(filler)
    s.wait()  # the persister's next try lands the commit
    assert watch.poll() == {}
    assert [e for e, _ in events] == ["health_failing", "health_recovered"]
    assert events[1][1]["check"] == "checkpoint_persist"
    s.close()


def test_a_job_without_the_flash_saver_has_no_flash_check(job):
    assert HealthWatch(PluginManager(), job, {"checkpoint": {"saver": "disk"}},
                       print).poll() == {}


def test_a_persister_killed_and_replaced_shows_in_the_jobs_health(job, tmp_path):
    """SIGKILL of a node's persister: the rank's next save starts a new one, and the
    health poll that finds the new process reports ``persister_restarted``
    (``health_failing``), the poll after it ``health_recovered`` (the chaos run's kill
    of a persister was in no event before)."""
    import signal

    import ray

    from dlrover_plugin_flashckpt.persister import get_persister

    d = str(tmp_path / "ckpt")
    events: list[tuple[str, dict]] = []
    spec = {"checkpoint": {"saver": "flash", "dir": d}}
    watch = HealthWatch(PluginManager(), job, spec, lambda e, **f: events.append((e, f)))
    s = FlashSaver(SaverConfig(dir=d, keep=2, job=job, options={"wait_timeout_s": 60}),
                   SaverContext())
    s.save(1, {"w": torch.arange(1000, dtype=torch.float32)})
    s.wait()
    assert watch.poll() == {}
    old = ray.get(get_persister(job, create=False).status.remote(), timeout=30)["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    step = 2
    while "persister_restarted" not in watch.current():
        assert time.monotonic() < deadline, f"no persister_restarted in the health: {events}"
        try:
            s.save(step, {"w": torch.arange(1000, dtype=torch.float32) + step})
            step += 1
        except Exception:  # noqa: BLE001 - the dead persister seen by this save; next one
            pass
        time.sleep(0.5)
        watch.poll()
    [(node, state)] = watch.current()["persister_restarted"].items()
    assert f"pid {old}" in state["error"]
    assert ("health_failing", "persister_restarted") in [(e, f.get("check")) for e, f in events]
    assert watch.poll().get("persister_restarted") is None
    assert ("health_recovered", "persister_restarted") in [(e, f.get("check"))
                                                           for e, f in events]
    s.wait()
    s.close()


def test_a_save_into_a_full_checkpoint_folder_stays_in_memory(job, small_tmpfs):  # noqa: F811
    """The first save of an attempt writes the folder's lineage; with the folder full to
    the last byte that write fails with ENOSPC. The save goes on into memory instead of
    failing the rank (the chaos run's full disk during a restart failed the job as a
    'deterministic' error), and once space is back the next save writes the lineage and
    is committed."""
    from dlrover_core.checkpoint.saver import committed_steps
    from dlrover_plugin_flashckpt.lineage import LINEAGE

    d = os.path.join(small_tmpfs, "ckpt")
    os.makedirs(d)
    filler = os.path.join(small_tmpfs, "filler")
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                f.write(b"\0" * 4096)
            except OSError:
                break
    s = FlashSaver(SaverConfig(dir=d, keep=2, job=job, options={"wait_timeout_s": 60}),
                   SaverContext())
    s.save(1, {"w": torch.arange(1000, dtype=torch.float32)})  # no lineage: ENOSPC
    assert not os.path.exists(os.path.join(d, LINEAGE))
    os.unlink(filler)
    s.save(2, {"w": torch.arange(1000, dtype=torch.float32) + 2})
    s.wait()
    assert os.path.exists(os.path.join(d, LINEAGE))
    assert committed_steps(d)[-1] == 2
    s.close()
