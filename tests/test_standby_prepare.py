"""A spare's ``prepare()`` also imports the job's checkpoint saver and the backend's
state-dict engine (and looks up the JobMaster, not checked here: Ray keeps no public
record of a loaded actor class), so that a promoted spare's first checkpoint load does
not pay those on the recovery's path, and freezes its heap (``gc.freeze``), as a fresh
worker's first ``setup()`` does before the workload's own. Real ``WorkloadHost`` actors
and a real named actor under the master's name (the lookup finds it)."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import ray

from dlrover_core.runtime.context import MASTER_NAMESPACE, WorkerContext, master_actor_name
from dlrover_core.runtime.host import remote_workload_host
from tests.workloads import shard_coordinates_after_a_step

SAVER_MODULE = "dlrover_plugin_flashckpt.saver"


@ray.remote(num_cpus=0)
class _Master:
    def ping(self) -> bool:
        return True


def _modules(host, *names: str) -> list[bool]:
    return ray.get(host.__ray_call__.remote(
        lambda self, ns: [n in sys.modules for n in ns], names), timeout=60)


def _frozen(host) -> int:
    return ray.get(host.__ray_call__.remote(lambda self: gc.get_freeze_count()), timeout=60)


def test_a_spare_imports_the_saver_and_finds_the_master_before_it_is_promoted(ray_cluster):
    master = _Master.options(name=master_actor_name("prep"), namespace=MASTER_NAMESPACE,
                             lifetime="detached").remote()
    ray.get(master.ping.remote(), timeout=60)
    host = remote_workload_host().options(num_cpus=0).remote(
        "tests.workloads:Echo", WorkerContext(
            job="prep", role="trainer", rank=0, world_size=2, local_rank=0,
            local_world_size=2, backend="fsdp", checkpoint={"saver": "flash"}))
    try:
        assert _modules(host, SAVER_MODULE) == [False]  # a fresh process has not
        before = _frozen(host)
        ray.get(host.prepare.remote(), timeout=120)
        assert _modules(host, SAVER_MODULE, "dlrover_plugin_fsdp.engine") == [True, True]
        # the imports and the warm-up's objects are out of every later collection
        assert _frozen(host) > before
    finally:
        ray.kill(host)
        ray.kill(master)


def test_a_spare_maps_its_roles_flash_slots_on_its_node_while_it_waits(ray_cluster, tmp_path):
    """``prepare()`` runs the saver's ``prepare_standby``: a spare of a flash job maps the
    slots of its role's checkpoint directory on its node (every rank's: it does not know
    its own yet), with their page tables filled, and not those of another directory.
    The slots are made by a real flash saver in this process (rank 0 of one)."""
    import uuid

    import torch

    from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
    from dlrover_plugin_flashckpt import shm
    from dlrover_plugin_flashckpt.persister import finish_job
    from dlrover_plugin_flashckpt.saver import FlashSaver

    job = f"premap-{uuid.uuid4().hex[:8]}"
    root = str(tmp_path / "ckpt")

    def saver(role):
        return FlashSaver(SaverConfig(dir=f"{root}/{role}", keep=2, job=job,
                                      options={"wait_timeout_s": 60}), SaverContext())

    mine, other = saver("trainer"), saver("critic")
    host = None
    try:
        for s in (mine, other):
            s.save(1, {"w": torch.ones(1000)})
            s.wait()
        host = remote_workload_host().options(num_cpus=0).remote(
            "tests.workloads:Echo", WorkerContext(
                job=job, role="trainer", rank=0, world_size=1, local_rank=0,
                local_world_size=1, checkpoint={"saver": "flash", "dir": root,
                                                "options": {"wait_timeout_s": 60}}))
        ray.get(host.prepare.remote(), timeout=120)

        def premapped(self):
            from dlrover_plugin_flashckpt import premap

            p = premap._current
            return None if p is None else sorted(
                (path, seg.populated) for path, seg in p.mapped.items())

        got = ray.get(host.__ray_call__.remote(premapped), timeout=60)
        assert got == sorted((path, True) for path in mine.paths)
    finally:
        if host is not None:
            ray.kill(host)
        for s in (mine, other):
            s.close()
        finish_job(job, timeout=30, grace_s=3.0)
        for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
            os.unlink(path)


def test_the_first_setup_freezes_the_imports_and_not_what_the_workload_makes(ray_cluster):
    """Frozen objects are never collected: what a workload's ``setup()`` makes must stay
    collectable, or a re-setup in place (after a peer failed) would leak the old model
    (a model with hooks is a reference cycle)."""
    host = remote_workload_host().options(num_cpus=0).remote(
        "tests.workloads:HeapProbe", WorkerContext(job="heap", role="trainer", rank=0,
                                                   world_size=1, local_rank=0,
                                                   local_world_size=1))
    try:
        before = _frozen(host)
        ray.get(host.setup.remote("", 0), timeout=60)
        first = ray.get(host.call.remote("heap"), timeout=60)
        assert first["frozen"] > before and first["alive"] == [True]
        ray.get(host.setup.remote("", 0, 1), timeout=60)  # re-setup in place
        second = ray.get(host.call.remote("heap"), timeout=60)
        # the first setup's cycle was freed; the re-setup froze nothing more (frozen
        # objects that refcounting frees leave the permanent generation)
        assert second["alive"] == [False, True] and second["frozen"] <= first["frozen"]
    finally:
        ray.kill(host)


def test_a_spare_promoted_to_rank_1_holds_rank_1_s_shards_after_the_backend_warm_up(
        ray_cluster):
    """The ``fsdp`` backend's warm-up trains a small model on a fake group as rank 0.
    torch caches DTensor sharding propagation per thread with the mesh it was computed
    on, and meshes of the same ranks compare equal whatever their local rank: run in the
    thread that later runs the workload, the warm-up's mesh (coordinate 0) came back
    for a promoted rank 1's tensors of the warm-up's shapes. ``prepare()`` runs it in a
    thread of its own; the model here has the warm-up's shapes."""
    host = remote_workload_host().options(num_cpus=0).remote(
        "tests.workloads:Echo", WorkerContext(
            job="coord", role="trainer", rank=0, world_size=2, local_rank=0,
            local_world_size=2, backend="fsdp"))
    try:
        ray.get(host.prepare.remote(), timeout=120)
        # in the actor's default thread, where setup() and run() of a promoted spare run
        coords = ray.get(host.__ray_call__.remote(
            lambda self: shard_coordinates_after_a_step(1, 2)), timeout=120)
        assert coords == [(1,), (1,)]
    finally:
        ray.kill(host)


def _threads(host) -> dict[int, tuple[int, int]]:
    """Thread id -> (scheduling policy, nice value), of the actor's process (read here:
    the actor may be busy in ``prepare()``)."""
    pid = ray.get(host.node_info.remote(), timeout=60)["pid"]
    out = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            out[tid] = (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))
        except ProcessLookupError:
            pass
    return out


def _as_before(now: dict, before: dict) -> bool:
    """Every thread of ``before`` still alive has its policy and nice value back."""
    return all(v == before[t] for t, v in now.items() if t in before)


def test_a_spare_warms_up_under_sched_idle_and_a_promotion_raises_it_back(ray_cluster,
                                                                         tmp_path):
    """``prepare()`` runs every thread of the spare's process under ``SCHED_IDLE``
    (threads it starts too) and gives each its policy back when it returns (nice values
    kept: Ray's 15 and 0); ``hurry()`` (a promotion that finds the spare warming) does
    it at once. Needs ``CAP_SYS_NICE`` (root in CI), or nothing is lowered."""
    import json
    import time

    from dlrover_core.runtime.warming import _may_raise_priority

    if not _may_raise_priority(0):
        pytest.skip("this machine's processes may not raise their priority back")
    probe = {"env_vars": {"PRIORITY_PROBE_DIR": str(tmp_path)}}
    ctx = WorkerContext(job="idle", role="trainer", rank=0, world_size=1, local_rank=0,
                        local_world_size=1)
    for hurried in (True, False):   # prepare() (idle) raised back by hurry(), or not
        for f in ("started", "go", "warm.json"):
            (tmp_path / f).unlink(missing_ok=True)
        host = remote_workload_host().options(num_cpus=0, runtime_env=probe).remote(
            "tests.workloads:PriorityProbe", ctx)
        try:
            before = _threads(host)
            assert {p for p, _ in before.values()} == {os.SCHED_OTHER}
            prepared = host.prepare.remote()
            deadline = time.monotonic() + 60
            while not (tmp_path / "started").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            # every thread, Ray's too, but the timer that would raise it after 30 s
            during = [p for p, _ in _threads(host).values()]
            assert during.count(os.SCHED_OTHER) == 1
            assert set(during) == {os.SCHED_OTHER, os.SCHED_IDLE}
            if hurried:
                ray.get(host.hurry.remote(), timeout=10)
                assert _as_before(_threads(host), before)
            (tmp_path / "go").touch()
            ray.get(prepared, timeout=60)
            seen = json.loads((tmp_path / "warm.json").read_text())
            assert seen["before"] == seen["child"] == os.SCHED_IDLE
            assert (seen["after"], seen["nice"]) == (
                before[seen["tid"]] if hurried else (os.SCHED_IDLE, before[seen["tid"]][1]))
            assert _as_before(_threads(host), before)
        finally:
            ray.kill(host)
    # a role's first spare: prepare(idle=False) runs at the process's own priority
    for f in ("started", "go", "warm.json"):
        (tmp_path / f).unlink(missing_ok=True)
    (tmp_path / "go").touch()
    host = remote_workload_host().options(num_cpus=0, runtime_env=probe).remote(
        "tests.workloads:PriorityProbe", ctx)
    try:
        ray.get(host.prepare.remote(False), timeout=120)
        seen = json.loads((tmp_path / "warm.json").read_text())
        assert seen["before"] == seen["child"] == seen["after"] == os.SCHED_OTHER
    finally:
        ray.kill(host)
