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
- ``gloo`` (module): a one-process gloo ``torch.distributed`` group.

Helpers (plain functions): real Ray clusters (``start_test_ray``,
``multinode_cluster``), whole jobs (``run_job``, ``poll_status``, ``run_killing``,
``master_node_id``: in :mod:`dlrover_core.testing.jobs`),
roles outside a job (``spawn_role``, ``call_all``, ``kill_actors``), a torchrun-style
script's process (``torchrun_script_pid``), the ``dlrover`` command
(``dlrover_json``, ``plugin_row``, ``heavy_modules_after``), state dicts
(``flatten_state``, ``assert_states_equal``) and the devices of ``torch.distributed``'s
collectives (``check_collective_devices``); these three and ``gloo`` are in
:mod:`dlrover_core.testing.tensors`.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pytest

from dlrover_core.testing.jobs import master_node_id, poll_status, run_job, run_killing
from dlrover_core.testing.tensors import (assert_states_equal, check_collective_devices,
                                          end_rank_process, flatten_state, gloo)

__all__ = ["assert_states_equal", "call_all", "check_collective_devices", "dlrover_json",
           "end_rank_process", "fake_dist", "flatten_state", "gloo", "heavy_modules_after",
           "job_dir", "kill_actors", "make_fake_dist", "master_node_id", "multinode_cluster",
           "plugin_manager", "plugin_row", "poll_status", "ray_cluster", "_test_ray_dirs",
           "run_job", "run_killing",
           "spawn_role", "start_test_ray", "torchrun_script_pid"]


def start_test_ray(num_cpus: int | None = None, **kwargs) -> str:
    """Start a local Ray cluster owned by this process in a fresh temp dir; returns it."""
    from dlrover_core.master.client import init_ray

    temp_dir = tempfile.mkdtemp(prefix="dlr", dir="/tmp")
    cpus = num_cpus or int(os.environ.get("DLROVER_TEST_CPUS", "4"))
    init_ray(None, num_cpus=cpus, _temp_dir=temp_dir, **kwargs)
    return temp_dir


@contextlib.contextmanager
def multinode_cluster(workers: int, cpus: float, head_cpus: float = 0,
                      connect: bool = True, gpus: float = 0,
                      ) -> Iterator[tuple[Any, dict[str, Any]]]:
    """A several-node ``ray.cluster_utils.Cluster`` on this machine, in a fresh temp dir
    and without a dashboard: a head with ``head_cpus`` CPUs and ``workers`` worker nodes
    of ``cpus`` CPUs each (and ``gpus`` GPUs declared: Ray schedules them, no device
    exists), all started before it yields. ``connect``: this process joins
    it (``init_ray``). Yields ``(cluster, nodes)``, ``nodes`` mapping each worker's node
    id (hex) to its node handle (for ``cluster.remove_node``). On exit this process leaves
    Ray, the cluster is shut down and its temp dir removed."""
    import ray
    from ray.cluster_utils import Cluster

    from dlrover_core.master.client import init_ray

    temp_dir = tempfile.mkdtemp(prefix="dlc", dir="/tmp")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": head_cpus, "num_gpus": 0, "temp_dir": temp_dir,
        "include_dashboard": False})
    try:
        nodes = {}
        for _ in range(workers):
            node = cluster.add_node(num_cpus=cpus, num_gpus=gpus)
            nodes[node.node_id] = node
        cluster.wait_for_nodes()
        if connect:
            if ray.is_initialized():  # another cluster's connection (a shared test cluster)
                ray.shutdown()
            init_ray(cluster.address)
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def _test_ray_dirs() -> Iterator[list[str]]:
    """The temp dirs of the test clusters :func:`ray_cluster` started; at the session's
    end this process leaves Ray and they are removed."""
    import ray

    dirs: list[str] = []
    yield dirs
    if dirs:
        ray.shutdown()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster(_test_ray_dirs: list[str]) -> Iterator[None]:
    """A local Ray cluster this process is connected to, shared by the modules of the
    session: started once, and started again at the start of a module when an earlier
    module's test left Ray (a several-node cluster of its own, ``ray.shutdown()``), so a
    module never finds itself without one (its jobs would start embedded clusters whose
    workers miss the test directory on their path)."""
    import ray

    if not ray.is_initialized():
        _test_ray_dirs.append(start_test_ray())
    yield


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
               backend: str | None = None, job: str = "test", num_gpus: float = 0) -> list:
    """Start ``world_size`` real ``WorkloadHost`` actors of ``workload`` outside a job and
    run their ``setup()`` (with the role's rendezvous when ``backend`` is set). Each
    actor asks Ray for ``num_gpus`` GPUs (a fraction shares one). Returns the handles in
    rank order; kill them with ``ray.kill``."""
    import ray

    from dlrover_core.runtime.context import WorkerContext
    from dlrover_core.runtime.host import remote_workload_host

    cls = remote_workload_host()
    handles = [cls.options(num_cpus=0, num_gpus=num_gpus).remote(workload, WorkerContext(
        job=job, role=role, rank=r, world_size=world_size, local_rank=r,
        local_world_size=world_size, backend=backend, config=config or {},
        failover={"pg_timeout_s": 60})) for r in range(world_size)]
    info = ray.get(handles[0].node_info.remote())
    port = ray.get(handles[0].rendezvous_port.remote())
    ray.get([h.setup.remote(info["ip"], port) for h in handles])
    return handles


def call_all(handles: Iterable[Any], method: str, *args: Any) -> list:
    """``method(*args)`` of the workload of each ``WorkloadHost`` in ``handles`` (its
    ``call``), all at once; the results in the order of ``handles``."""
    import ray

    return ray.get([h.call.remote(method, *args) for h in handles])


def kill_actors(handles: Iterable[Any]) -> None:
    """``ray.kill`` each actor handle, without restart."""
    import ray

    for h in handles:
        ray.kill(h, no_restart=True)


def torchrun_script_pid(run_id: str, rank: int, restart: int = 0, script: str = "train.py",
                        timeout: float = 120) -> int:
    """The pid of the process that runs ``script`` as ``rank`` of the torchrun-style job
    ``run_id`` (``TORCHELASTIC_RUN_ID``) in its ``restart``-th group restart
    (``TORCHELASTIC_RESTART_COUNT``), found in /proc (``dlrover-run`` and ``torchrun``
    set these variables).

    Raises:
        AssertionError: no such process within ``timeout`` seconds.
    """
    want = {f"TORCHELASTIC_RUN_ID={run_id}", f"RANK={rank}",
            f"TORCHELASTIC_RESTART_COUNT={restart}"}
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = set(Path(f"/proc/{pid}/environ").read_bytes().decode(
                    "utf-8", "replace").split("\0"))
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if want <= env and script.encode() in cmd:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"no {script} process {want}")


def dlrover_json(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> Any:
    """Run ``dlrover <args> --json`` (``python -m dlrover_core.cli.main``) in a fresh
    interpreter (environment ``env``, default this one's) and parse its stdout.

    Raises:
        subprocess.CalledProcessError: the command exited non-zero.
    """
    out = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", *args, "--json"],
                         env=env, capture_output=True, text=True, check=True,
                         timeout=timeout).stdout
    return json.loads(out)


def plugin_row(name: str, env: dict[str, str] | None = None) -> dict:
    """The row of plugin ``name`` in ``dlrover plugins list --json`` (keys ``name``,
    ``version``, ``distribution``, ``hooks``, ``provides``, ``status``, ``error``).

    Raises:
        KeyError: no plugin of that name is listed.
    """
    return {r["name"]: r for r in dlrover_json("plugins", "list", env=env)}[name]


def heavy_modules_after(code: str, heavy: Iterable[str] = ("torch",)) -> list[str]:
    """Run ``code`` in a fresh interpreter; the top-level package names among ``heavy``
    that are imported afterwards (sorted; ``[]``: none).

    Raises:
        subprocess.CalledProcessError: ``code`` raised.
    """
    probe = (f"{code}\nimport json as _j, sys as _s\n"
             f"print(_j.dumps(sorted({{m.split('.')[0] for m in _s.modules}} & {set(heavy)!r})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


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

