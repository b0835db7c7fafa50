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


def test_a_master_restarted_before_its_next_poll_still_reports_the_replaced_persister(
        job, tmp_path):
    """The chaos run (elastic, seed 7, CI of 2026-12-02) SIGKILLed a persister and
    0.2 s later the JobMaster: the restarted master's first poll knew no pid from before
    and the replacement went unreported. The master here is a real Ray actor that Ray
    restarts under the same id after a SIGKILL; another run's master (another actor)
    must not take the pids the first one stored for its own run."""
    import signal

    import ray

    from dlrover_plugin_flashckpt.persister import get_persister

    @ray.remote(max_restarts=1, num_cpus=0)
    class Master:
        def pid(self) -> int:
            return os.getpid()

        def restarts(self, name: str) -> dict:
            from dlrover_plugin_flashckpt.plugin import persister_restarts

            return persister_restarts(name)

    s = FlashSaver(SaverConfig(dir=str(tmp_path / "ckpt"), keep=2, job=job,
                               options={"wait_timeout_s": 60}), SaverContext())
    s.save(1, {"w": torch.arange(1000, dtype=torch.float32)})
    s.wait()
    master, other = Master.remote(), Master.remote()
    assert ray.get(master.restarts.remote(job), timeout=60) == {}  # the first poll
    old = ray.get(get_persister(job, create=False).status.remote(), timeout=30)["pid"]
    master_pid = ray.get(master.pid.remote(), timeout=30)
    os.kill(old, signal.SIGKILL)
    os.kill(master_pid, signal.SIGKILL)
    deadline, step, new = time.monotonic() + 120, 2, old
    while new == old:  # the rank's next save starts a new persister
        assert time.monotonic() < deadline, "no new persister after the SIGKILL"
        try:
            s.save(step, {"w": torch.arange(1000, dtype=torch.float32) + step})
            step += 1
            new = ray.get(get_persister(job, create=False).status.remote(), timeout=30)["pid"]
        except Exception:  # noqa: BLE001 - the dead persister seen by this save; next one
            time.sleep(0.5)
    while True:  # Ray restarts the master under the same actor id
        assert time.monotonic() < deadline, "the master actor was not restarted"
        try:
            if ray.get(master.pid.remote(), timeout=30) != master_pid:
                break
        except ray.exceptions.RayActorError:
            time.sleep(0.5)
    assert ray.get(other.restarts.remote(job), timeout=60) == {}  # not its run's pids
    [(node, state)] = ray.get(master.restarts.remote(job), timeout=60).items()
    assert f"pid {old}" in state["error"] and f"pid {new}" in state["error"], state
    assert ray.get(master.restarts.remote(job), timeout=60) == {}  # reported once
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
