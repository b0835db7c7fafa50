"""Client side: start (or join) Ray, create the JobMaster, follow the job.

``address=None`` starts an embedded local Ray cluster that lives as long as the
``dlrover submit`` process; ``--address auto`` or ``HOST:PORT`` joins an existing
cluster (``ray start`` on machines, KubeRay on Kubernetes).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from dlrover_core.master.dir_lock import HANDOVER_S, DirLock, LockKeeper
from dlrover_core.runs import read_summary  # noqa: F401 - re-exported (the CLI, tests)
from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

#: the default of ``failover.master_max_restarts``: Ray's restarts of the JobMaster actor
MASTER_MAX_RESTARTS = 3
HEAD_RESOURCE = "node:__internal_head__"  # Ray puts it (1.0) on the head node only
HEAD_RESOURCE_SHARE = 0.001  # what the master and the lock keeper ask of it


class JobNotFound(LookupError):
    """No running JobMaster and no job directory for the name."""


def init_ray(address: str | None = None, verbose: bool = False,
             working_dir: str | None = None, **kwargs: Any) -> bool:
    """Start or join Ray unless already connected. Returns True when this call started
    an embedded local cluster. ``address=None`` or ``"auto"`` with ``RAY_ADDRESS`` set
    joins that address, as ``ray.init`` does; joining by address turns on Ray's token
    authentication when a token is found (:mod:`dlrover_core.master.ray_auth`).

    Raises:
        ClusterAuthError: the cluster refused this process for want of a token.

    The current directory and ``PYTHONPATH`` are put on the workers' ``PYTHONPATH`` so
    that ``workload: package.module:Class`` resolves as it does here; with
    ``working_dir``, that directory is shipped with the job (Ray's ``runtime_env``
    ``working_dir``: the workers run in a copy of it, first on their ``sys.path``) in
    place of the current directory.
    """
    import ray

    if ray.is_initialized():
        return False
    from dlrover_core.master import ray_auth

    if address in (None, "auto") and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]  # as ray.init() itself reads it
    if address not in (None, "local", "auto"):
        ray_auth.prepare_token_auth(address)
        ray_auth.check_token(address)
    else:  # Ray's own notice on every command, said once by us instead
        ray_auth.quiet_token_auth(starting=address != "auto")
    paths = ([] if working_dir else [os.getcwd()]) + \
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    runtime_env: dict[str, Any] = {
        "env_vars": {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}}
    if working_dir:
        runtime_env["working_dir"] = os.path.abspath(working_dir)
    if not sys.stderr.isatty():  # Ray's own lines ("(raylet) ...") without colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    try:
        ray.init(address=address or "local", namespace=MASTER_NAMESPACE,
                 runtime_env=runtime_env, log_to_driver=False, include_dashboard=False,
                 configure_logging=verbose, logging_level="INFO" if verbose else "ERROR",
                 **kwargs)
    except Exception as exc:
        if address not in (None, "local") and ray_auth.is_auth_failure(exc):
            raise ray_auth.missing_token_error(address, exc) from exc
        raise
    return address is None


def get_master(name: str) -> Any:
    """The JobMaster handle of a running job, or ``None``."""
    import ray

    try:
        return ray.get_actor(master_actor_name(name), namespace=MASTER_NAMESPACE)
    except ValueError:
        return None


def create_master(spec: DictConfig, job_dir: str, fresh: bool = False) -> Any:
    """Create the named, detached JobMaster actor of ``spec.name``: a new run in
    ``job_dir`` (``fresh``: without resuming from the old checkpoints, which are moved
    to ``<job_dir>/run-<N>/ckpt``; see :func:`dlrover_core.runs.begin_run`).

    Raises:
        RuntimeError: a job of that name is already running.
    """
    import ray

    from dlrover_core.master.job_master import JobMaster

    if get_master(spec.name) is not None:
        raise RuntimeError(f"job {spec.name!r} is already running; `dlrover stop {spec.name}` "
                           "first, or choose another name")
    cls = ray.remote(concurrency_groups={"report": 1})(JobMaster)
    return cls.options(
        name=master_actor_name(spec.name), namespace=MASTER_NAMESPACE, lifetime="detached",
        max_restarts=int(spec.failover.get("master_max_restarts", MASTER_MAX_RESTARTS)),
        max_concurrency=64, num_cpus=0, **_master_placement(),
    ).remote(OmegaConf.to_container(spec, resolve=True), job_dir, fresh)


def _master_placement() -> dict[str, Any]:
    """Ray options placing the JobMaster (and a detached job's lock keeper): on the head,
    by a sliver (0.001) of Ray's ``node:__internal_head__`` resource, which only the
    current head has, so the master's restarts after a head restart (GCS fault
    tolerance) go to the new head (a hard affinity to the head's node id could not be
    met by a new head). Without a head in the table: a soft affinity to this process's
    node (a 0-CPU actor with a soft affinity to a head without CPUs landed on a worker
    node every time, and a worker's loss then took the master with it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if head_node_id() is not None:
        return {"resources": {HEAD_RESOURCE: HEAD_RESOURCE_SHARE},
                "scheduling_strategy": "DEFAULT"}
    here = ray.get_runtime_context().get_node_id()
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=True)}


def head_node_id() -> str | None:
    """The id of the cluster's alive head node (the one with Ray's
    ``node:__internal_head__`` resource), or ``None``. A driver on a machine with
    several nodes may attach to any of them; the JobMaster belongs on the head, the
    node whose loss ends the cluster anyway."""
    import ray

    return next((n["NodeID"] for n in ray.nodes()
                 if n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {})),
                None)


def default_job_dir(name: str) -> str:
    return os.path.abspath(os.path.join("runs", name))


def submit_job(spec: DictConfig, address: str | None = None, job_dir: str | None = None,
               progress: bool = True, verbose: bool = False, fresh: bool = False,
               working_dir: str | None = None, wait: bool = True) -> dict:
    """Run a validated job to its end (a new run in ``job_dir``) and return its summary
    (``summary.json``). A run resumes from the job's checkpoints and says so on stderr
    (step, memory or disk, path); ``fresh`` moves them aside instead. ``working_dir``:
    a directory of code shipped with the job (see :func:`init_ray`). ``wait=False``
    returns once the JobMaster started the run (``{"name", "run", "job_dir", "status":
    "submitted"}``): the job goes on without this process, so it needs a cluster that
    outlives it (``address``).

    Ctrl-C stops the job (embedded cluster) or detaches (joined cluster: the job goes on).
    The job directory and the checkpoint folder are locked until this returns
    (:func:`run_locks`); a job that goes on without this process (``wait=False``, a
    Ctrl-C detach) keeps them locked until it reaches a terminal state: they are handed
    over to a lock keeper actor (:func:`hand_over_locks`).

    Raises:
        DirInUseError: another run holds the job directory or the checkpoint folder.
        SpecError: ``fresh`` with a ``checkpoint.dir`` URI of a remote protocol (its
            checkpoints cannot be moved aside).
    """
    job_dir = os.path.abspath(job_dir or default_job_dir(spec.name))
    ckpt = checkpoint_dir(spec, job_dir)
    if fresh and "://" in ckpt:
        from dlrover_core.spec.errors import SpecError

        raise SpecError("checkpoint.dir", ckpt, "with --fresh, a local path or a file:// URI",
                        "a fresh run cannot move the checkpoints of a remote store aside: "
                        "clear that location and submit without --fresh")
    with run_locks(spec, job_dir) as locks:
        done = None if fresh else complete_from_files(spec, job_dir)
        if done is not None:
            return done
        return _submit_locked(spec, address, job_dir, progress, verbose, fresh, working_dir,
                              wait, locks)


def complete_from_files(spec: DictConfig, job_dir: str) -> dict | None:
    """The summary of a submit with nothing to train, decided from the job directory and
    its checkpoints before Ray starts (a second instead of a cluster's start-up), or
    ``None`` when that is not certain, and the run must start to find out.

    Certain means: the saver is ``disk`` (whose folder alone says what a resume loads;
    other savers' memory copies and lineages are left to the run); ``config.max_steps``
    is set; the latest run ended ``succeeded`` or
    ``already_complete``; the steps it left (its ``checkpoint_steps``, else where it
    resumed from) are each at or past ``max_steps``; and each is still the newest
    committed step of its role's local checkpoint folder (``<ckpt>/<role>/step_<n>``
    with its manifest), with no rollback marker beside it. Then the JobMaster would
    resume every role at that step and end at once (``already_complete``). The summary
    has ``status`` ``already_complete``, ``run`` ``None`` (no run is started, none is
    numbered), ``resumed_from`` the checkpoint of each role and ``decided`` ``"from the
    checkpoints, before starting"``."""
    from dlrover_core.checkpoint.rollback import MARKER
    from dlrover_core.checkpoint.saver import committed_steps

    max_steps = OmegaConf.select(spec, "config.max_steps")
    prev = read_summary(job_dir)
    if OmegaConf.select(spec, "checkpoint.saver") != "disk" \
            or not isinstance(max_steps, int) or prev is None \
            or prev.get("status") not in ("succeeded", "already_complete"):
        return None
    steps = {role: int(r["step"]) for role, r in (prev.get("resumed_from") or {}).items()}
    steps.update({role: int(n) for role, n in (prev.get("checkpoint_steps") or {}).items()})
    ckpt = checkpoint_dir(spec, job_dir)
    if not steps or "://" in ckpt or not set(steps) <= set(spec.roles):
        return None
    resumed = {}
    for role, step in steps.items():
        folder = os.path.join(ckpt, role)
        have = committed_steps(folder)
        if step < max_steps or not have or have[-1] != step \
                or os.path.exists(os.path.join(folder, MARKER)):
            return None
        resumed[role] = {"step": step, "source": "disk",
                         "path": os.path.join(folder, f"step_{step:08d}")}
    first = min(steps.values())
    return {"name": spec.name, "run": None, "status": "already_complete",
            "decided": "from the checkpoints, before starting",
            "error": (f"nothing to train: the checkpoint of step {first} already reaches "
                      f"config.max_steps={max_steps} (decided from {ckpt} before anything "
                      "started); raise config.max_steps, or submit with --fresh to start "
                      "over (the old checkpoints are kept)"),
            "resumed_from": resumed, "metrics": {}, "steps": 0, "restarts": {"total": 0},
            "wall_s": 0.0, "job_dir": job_dir}


def checkpoint_dir(spec: DictConfig, job_dir: str) -> str:
    """The job's checkpoint folder: ``checkpoint.dir`` (a path relative to the current
    directory, a ``file://`` URI: its absolute path) or ``<job_dir>/ckpt``; a URI of
    another protocol (``s3://...``, any fsspec protocol) is returned as it is."""
    from dlrover_core.checkpoint.storage import local_path

    ck = spec.get("checkpoint") or {}
    location = str(ck.get("dir") or os.path.join(job_dir, "ckpt"))
    path = local_path(location)
    return location if path is None else os.path.abspath(path)


@contextmanager
def run_locks(spec: DictConfig, job_dir: str) -> Iterator[list[DirLock]]:
    """Hold exclusive locks (:mod:`.dir_lock`) on ``job_dir`` and on the checkpoint
    folder for the life of this run (yields them: :func:`hand_over_locks`). A checkpoint
    URI of a remote protocol is not locked (a lock file needs a local or NFS folder):
    only the job directory is.

    Raises:
        DirInUseError: another run holds one of them (nothing was written there).
    """
    ckpt = checkpoint_dir(spec, job_dir)
    with DirLock(job_dir, "job directory", spec.name) as jd:
        if "://" in ckpt:
            yield [jd]
            return
        with DirLock(ckpt, "checkpoint folder", spec.name) as ck:
            yield [jd, ck]


def hand_over_locks(name: str, locks: list[DirLock]) -> dict | None:
    """Hand ``locks`` (held by this process) over to a new lock keeper actor
    (:class:`~dlrover_core.master.dir_lock.LockKeeper`, detached, on the JobMaster's
    node) that holds them until job ``name``'s JobMaster ends. No other process can
    take them in between (a handover marker, :meth:`DirLock.release`). Returns the
    keeper's ``{"pid", "host"}``, or ``None`` when it failed (printed to stderr: the
    directories are then not locked while the job runs)."""
    import uuid

    import ray

    token = uuid.uuid4().hex
    keeper = None
    try:
        keeper = ray.remote(LockKeeper).options(
            name=f"dlrover-lock-keeper-{name}-{token[:8]}", namespace=MASTER_NAMESPACE,
            lifetime="detached", max_restarts=0, num_cpus=0, max_concurrency=4,
            **_master_placement(),
        ).remote(name, master_actor_name(name), MASTER_NAMESPACE)
        ray.get(keeper.ready.remote(), timeout=HANDOVER_S)
        for lock in locks:
            lock.release(handover=token)
        return ray.get(keeper.take.remote([(lk.directory, lk.what) for lk in locks], token,
                                          HANDOVER_S), timeout=HANDOVER_S + 30)
    except Exception as exc:  # noqa: BLE001 - the job runs on; say what is not locked
        print(f"warning: the job directory and checkpoint folder of {name} are not locked "
              f"while it runs on ({type(exc).__name__}: {exc}); another submit could use "
              "them", file=sys.stderr)
        if keeper is not None:
            try:
                ray.kill(keeper, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        return None


def _submit_locked(spec: DictConfig, address: str | None, job_dir: str, progress: bool,
                   verbose: bool, fresh: bool = False, working_dir: str | None = None,
                   wait: bool = True, locks: list[DirLock] | None = None) -> dict:
    import ray

    started_here = init_ray(address, verbose=verbose, working_dir=working_dir)
    if not wait and started_here:
        ray.shutdown()
        raise ValueError("a job submitted without waiting needs a cluster that outlives "
                         "this command: give --address (e.g. auto, after `dlrover cluster up`)")
    master = create_master(spec, job_dir, fresh=fresh)
    ray.get(master.start.remote())
    if not wait:
        st = ray.get(master.status.remote(), timeout=30)
        hand_over_locks(spec.name, locks or [])
        return {"name": spec.name, "run": st.get("run"), "job_dir": job_dir,
                "status": "submitted", "state": st.get("state")}
    try:
        from dlrover_core.master.follow import follow

        summary = follow(master, progress=progress, job_dir=job_dir, verbose=verbose)
    except KeyboardInterrupt:
        if address is None:
            print("\nstopping the job ...", file=sys.stderr)
            master.stop.remote()
            summary = ray.get(master.wait.remote(60))
        else:
            print(f"\ndetached; the job goes on. `dlrover status {spec.name}` to follow it",
                  file=sys.stderr)
            hand_over_locks(spec.name, locks or [])
            raise
    try:  # the job ended and its hooks ran: free the name at once
        ray.kill(master, no_restart=True)
    except Exception:  # noqa: BLE001
        pass
    if summary is None:
        summary = read_summary(job_dir)
    if started_here:
        ray.shutdown()
    return summary
