"""pytest fixtures for dlrover-core and plugin authors.

Use from a ``conftest.py``::

    from dlrover_core.testing import *  # noqa: F401,F403

Fixtures:
- ``ray_cluster`` (session): a real local Ray cluster in its own short temp dir
  (``num_cpus`` from ``DLROVER_TEST_CPUS``, default 4); workers see the current
  directory on ``PYTHONPATH``.
- ``plugin_manager``: a fresh ``PluginManager`` installed as the process-wide one.
- ``fake_dist``: a factory that installs a fake distribution with a
  ``dlrover.plugins`` entry point on ``sys.path`` (no pip needed).
- ``job_dir``: a fresh job directory.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Callable, Iterator

import pytest

__all__ = ["fake_dist", "job_dir", "make_fake_dist", "plugin_manager", "poll_status",
           "ray_cluster", "spawn_role", "start_test_ray"]


def start_test_ray(num_cpus: int | None = None, **kwargs) -> str:
    """Start a local Ray cluster owned by this process in a fresh temp dir; returns it."""
    from dlrover_core.master.client import init_ray

    temp_dir = tempfile.mkdtemp(prefix="dlr", dir="/tmp")
    cpus = num_cpus or int(os.environ.get("DLROVER_TEST_CPUS", "4"))
    init_ray(None, num_cpus=cpus, _temp_dir=temp_dir, **kwargs)
    return temp_dir


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    if ray.is_initialized():
        yield
        return
    temp_dir = start_test_ray()
    yield
    ray.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def plugin_manager():
    from dlrover_core.plugins.manager import PluginManager, reset_plugin_manager

    pm = PluginManager()
    reset_plugin_manager(pm)
    yield pm
    reset_plugin_manager(None)


def make_fake_dist(root: Path, dist: str, plugin: str, module_source: str,
                   version: str = "0.0.1") -> Path:
    """Write an importable module ``<plugin>_fake_mod`` and a ``.dist-info`` whose entry
    point ``dlrover.plugins: <plugin> = <plugin>_fake_mod`` makes it a plugin.
    Returns ``root`` (put it on ``sys.path``)."""
    mod = f"{plugin.replace('-', '_')}_fake_mod"
    (root / f"{mod}.py").write_text(textwrap.dedent(module_source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[dlrover.plugins]\n{plugin} = {mod}\n")
    (info / "RECORD").write_text("")
    return root


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """``fake_dist(dist, plugin, module_source)`` installs a fake plugin distribution."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(dist: str, plugin: str, module_source: str, version: str = "0.0.1") -> Path:
        make_fake_dist(tmp_path, dist, plugin, module_source, version)
        importlib.invalidate_caches()
        return tmp_path

    return make


@pytest.fixture
def job_dir(tmp_path: Path) -> str:
    d = tmp_path / "job"
    d.mkdir()
    return str(d)


def _add_repo_to_path() -> None:  # examples/ are imported by tests run from the repo root
    root = os.getcwd()
    if root not in sys.path:
        sys.path.insert(0, root)


_add_repo_to_path()


def spawn_role(role: str, workload: str, world_size: int, config: dict | None = None,
               backend: str | None = None, job: str = "test") -> list:
    """Start ``world_size`` real ``WorkloadHost`` actors of ``workload`` outside a job and
    run their ``setup()`` (with the role's rendezvous when ``backend`` is set).
    Returns the handles in rank order; kill them with ``ray.kill``."""
    import ray

    from dlrover_core.runtime.context import WorkerContext
    from dlrover_core.runtime.host import remote_workload_host

    cls = remote_workload_host()
    handles = [cls.options(num_cpus=0).remote(workload, WorkerContext(
        job=job, role=role, rank=r, world_size=world_size, local_rank=r,
        local_world_size=world_size, backend=backend, config=config or {},
        failover={"pg_timeout_s": 60})) for r in range(world_size)]
    info = ray.get(handles[0].node_info.remote())
    port = ray.get(handles[0].free_port.remote())
    ray.get([h.setup.remote(info["ip"], port) for h in handles])
    return handles


def poll_status(master, until: Callable[[dict], bool], timeout: float = 240,
                interval: float = 0.1) -> dict:
    """Poll ``master.status()`` until ``until(status)`` holds; returns that status.
    A master that is restarting (``RayActorError``) is waited for.

    Raises:
        TimeoutError: ``until`` did not hold within ``timeout`` s.
    """
    import time

    import ray

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st = ray.get(master.status.remote(), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(interval)
            continue
        if until(st):
            return st
        time.sleep(interval)
    raise TimeoutError(f"the job's status did not reach the condition within {timeout} s")


def crash_renames_after(monkeypatch: pytest.MonkeyPatch, crash_at: int,
                        exchange: bool = True) -> list:
    """Make every rename after the first ``crash_at`` ones raise ``OSError("injected
    crash")``: ``os.rename``, ``os.replace`` and the atomic directory exchange of
    :mod:`dlrover_core.atomic_io` (``renameat2``). With ``exchange=False`` the exchange
    reports itself unsupported, so ``replace_dir`` takes its two-rename fallback.
    Returns the list of calls made (their arguments); ``monkeypatch.undo()`` restores
    the real functions."""
    import dlrover_core.atomic_io as aio

    real_rename, real_replace, real_exchange = os.rename, os.replace, aio._exchange
    calls: list = []

    def step(fn: Callable, *args):
        calls.append(args)
        if len(calls) > crash_at:
            raise OSError("injected crash")
        return fn(*args)

    monkeypatch.setattr(os, "rename", lambda a, b: step(real_rename, a, b))
    monkeypatch.setattr(os, "replace", lambda a, b: step(real_replace, a, b))
    monkeypatch.setattr(aio, "_exchange", (lambda a, b: step(real_exchange, a, b))
                        if exchange else (lambda a, b: False))
    return calls
