"""The per-node persister: a detached Ray actor per (job, node) that writes the
trainers' shared-memory saves to the checkpoint directory. Imports no torch.

It outlives the trainer processes of its node: when one dies, the step it saved in
memory is still there, and :meth:`FlashPersister.breakpoint` persists it. It is found
or created by the savers of its node (:func:`get_persister`), pinned to the node
(``NodeAffinitySchedulingStrategy(soft=False)``, ``num_cpus=0``), and ended by the
job's end (:func:`finish_job`).

Work loop (one background thread, so one persist at a time per node):

1. per role, the steps that every local rank holds in a READY slot, not yet
   persisted, and due (``persist_every_steps``) or forced (breakpoint, ``wait()``,
   job end); forced steps first, then steps another node already started, then the
   newest;
2. claim the slots (PERSISTING, under the slot lock), so no save overwrites them;
3. write each rank's meta and data (crc32 of the bytes written), mark them done;
   release the slots (READY, with the data crc32 recorded);
4. commit when every rank of the role is written (``storage.try_commit``); a save
   counts as persisted (``persisted_seq``) once its step is committed. A commit that
   cannot land yet (another node's ranks, a failure, an interrupted commit found on
   disk) is tried again; failures back off (0.5 s doubling to 30 s) and the status
   says since when persisting fails (``failing``), and when it recovered.

The loop is :mod:`.persisting`'s, the copies to a peer node :mod:`.replica`'s; the
functions that find the persisters from outside are :mod:`.handles`'.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from dlrover_plugin_flashckpt import hygiene, shm, storage
from dlrover_plugin_flashckpt.failures import PersistFailures

# re-exported: callers reach the persisters through this module
from dlrover_plugin_flashckpt.handles import (  # noqa: F401
    DEFAULT_SHM_DIR,
    NAMESPACE,
    alive_nodes,
    breakpoint_save,
    crashpoint_env,
    finish_job,
    persister_name,
    persisters_of,
)
from dlrover_plugin_flashckpt.persisting import POLL_S, PersistMixin, Registration  # noqa: F401
from dlrover_plugin_flashckpt.replica import ReplicaMixin

log = logging.getLogger(__name__)

#: seconds :meth:`FlashPersister.finish` waits, once this node's part of a step is
#: written, for the other nodes' ranks that its commit needs
FINISH_GRACE_S = 10.0


class FlashPersister(ReplicaMixin, PersistMixin):
    """Ray actor (threaded): see the module docstring. Create through
    :func:`get_persister`."""

    def __init__(self, job: str, session: str, node_id: str,
                 shm_dir: str = DEFAULT_SHM_DIR) -> None:
        logging.basicConfig(level=logging.INFO)
        self.job = job
        self.session = session
        self.node_id = node_id
        self.pid, self.start = shm.my_identity()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._regs: dict[tuple[str, int], Registration] = {}
        self._segs: dict[str, shm.Segment] = {}
        self._retired: list[shm.Segment] = []
        self._forced: dict[str, set[int]] = {}
        #: checkpoint directories this persister is committing a step to now
        self._committing: set[str] = set()
        self.current: dict | None = None
        self.history: list[dict] = []
        self.errors: list[str] = []
        #: failures in a row of the persist loop, and its backoff
        self.failures = PersistFailures()
        #: shared-memory directories already swept for stale buffers
        self._swept: set[str] = set()
        self.removed_stale = self._sweep(shm_dir)
        #: (role, rank) -> (step, seq) of the last save replicated to the peer
        self._replicated: dict[tuple[str, int], tuple[int, int]] = {}
        self._ray_only_peers: set[str] = set()   # peers the TCP replica path failed for
        #: finished replications: role, rank, step, peer, bytes, seconds
        self.replica_history: list[dict] = []
        self._repl_wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flash-persister", daemon=True)
        self._thread.start()
        self._repl_thread = threading.Thread(target=self._replicate_loop,
                                             name="flash-replicate", daemon=True)
        self._repl_thread.start()

    # ================================================================== actor API
    def ready(self) -> dict:
        """``pid``, ``node_id`` and the stale buffers removed at start."""
        return {"pid": self.pid, "node_id": self.node_id, "removed_stale": self.removed_stale}

    def saved(self, reg: dict, step: int | None = None) -> None:
        """A trainer saved (or just registered): remember its buffers, wake the loop."""
        r = Registration(**reg)
        if r.shm_dir not in self._swept:  # a directory first seen here: swept once
            self.removed_stale += self._sweep(r.shm_dir)
        with self._lock:
            for key, old in list(self._regs.items()):
                # the role came back with another world size (or directory): the ranks
                # of its earlier run must not hold back the new run's persistence
                if old.role == r.role and (old.world_size != r.world_size or old.dir != r.dir):
                    del self._regs[key]
            self._regs[(r.role, r.rank)] = r
            for path in r.slots:
                seg = self._seg(path)
                if seg is not None:
                    self._stamp(seg)
        self._wake.set()
        if r.replicas:
            self._repl_wake.set()
    def _sweep(self, shm_dir: str) -> list[str]:
        """Remove the stale buffers in ``shm_dir`` (:func:`hygiene.remove_stale`) unless
        this persister did already; returns their names."""
        with self._lock:
            if shm_dir in self._swept:
                return []
            self._swept.add(shm_dir)
        return hygiene.remove_stale(shm_dir, self.session)

    def _peer(self, node_id: str) -> Any:
        """The persister actor of ``node_id`` (created there when missing, sweeping
        the shared-memory directory of this node's ranks)."""
        with self._lock:
            shm_dir = next((r.shm_dir for r in self._regs.values()), DEFAULT_SHM_DIR)
        return get_persister(self.job, node_id=node_id, shm_dir=shm_dir)

    # ------------------------------------------------------------ allowed paths
    def _allowed_shm_dir(self, shm_dir: str) -> str:
        """``shm_dir`` when it is ``/dev/shm`` or the shared-memory directory of a rank
        registered here, as an absolute path without symlinks.

        Raises:
            ValueError: any other directory (a caller-chosen path)."""
        with self._lock:
            allowed = {"/dev/shm"} | {r.shm_dir for r in self._regs.values()}
        if not isinstance(shm_dir, str) or shm_dir not in allowed \
                or os.path.realpath(shm_dir) != os.path.normpath(shm_dir):
            raise ValueError(f"flash persister of job {self.job!r}: shm_dir {shm_dir!r} is not "
                             f"allowed; allowed: {sorted(allowed)} (no symlinks)")
        return shm_dir

    def _allowed_dir(self, directory: str) -> str:
        """``directory`` when it can be the checkpoint directory of a role of this
        job: an absolute, normalized path; where ranks registered here, one of theirs
        or a sibling (another role under the job's checkpoint folder). A node that
        only holds replicas (no rank of the job) cannot tell more; the directory is
        only hashed into buffer names and recorded, never opened.

        Raises:
            ValueError: any other path."""
        with self._lock:
            dirs = {r.dir for r in self._regs.values()}
        ok = isinstance(directory, str) and os.path.isabs(directory) \
            and os.path.normpath(directory) == directory \
            and (not dirs or directory in dirs
                 or os.path.dirname(directory) in {os.path.dirname(d) for d in dirs})
        if not ok:
            raise ValueError(f"flash persister of job {self.job!r}: checkpoint dir "
                             f"{directory!r} is not this job's; registered: {sorted(dirs)}")
        return directory

    def held(self, role: str) -> dict:
        """Complete saves held in memory on this node for ``role``:
        ``{"world_size", "dir", "committed": newest committed step or None,
        "ranks": {rank: [steps]}}``."""
        with self._lock:
            regs = [r for (ro, _), r in self._regs.items() if ro == role]
            if not regs:
                return {"world_size": 0, "dir": "", "committed": None, "ranks": {}}
            out: dict[int, list[int]] = {}
            for r in regs:
                steps = []
                for path in r.slots:
                    seg = self._seg(path)
                    if seg is not None:
                        h = seg.read_header()
                        if shm.holds_step(h):
                            steps.append(h.step)
                out[r.rank] = sorted(steps)
            return {"world_size": regs[0].world_size, "dir": regs[0].dir,
                    "committed": storage.newest_committed(regs[0].dir), "ranks": out}

    def breakpoint(self, role: str, step: int) -> list[int]:
        """Persist ``step`` of ``role`` next (a trainer died): claim the local ranks'
        slots holding it now, so the restarted trainers cannot overwrite them, and queue
        it ahead of everything. Returns the ranks claimed."""
        with self._lock:
            claims = self._claim(role, step)
            self._forced.setdefault(role, set()).add(step)
        self._wake.set()
        log.warning("breakpoint save of %s step %d: claimed ranks %s", role, step,
                    [c.rank for c in claims])
        return [c.rank for c in claims]

    def flush(self, role: str, step: int | None = None, timeout: float = 600.0,
              wait: bool = True, reg: dict | None = None) -> int | None:
        """Persist ``step`` (default: the newest step every local rank of ``role``
        holds) even when it is not due; with ``wait``, block until it (or a newer step)
        is committed (renamed, ``latest`` moved, and older steps pruned to ``keep`` when
        this node's persister commits it) and return the newest committed step.
        ``reg``: the caller's registration (calls of a threaded actor may run out of
        order, so a ``saved`` sent just before may not have run yet).

        Raises:
            TimeoutError: not committed within ``timeout`` s (the message says which
                ranks' files are missing).
        """
        if reg is not None:
            self.saved(reg)
        with self._lock:
            regs = [r for (ro, _), r in self._regs.items() if ro == role]
            if not regs:
                return None
            directory, world = regs[0].dir, regs[0].world_size
            if step is None:
                common = self._common_steps(regs)
                if not common:
                    return storage.newest_committed(directory)
                step = max(common)
            self._forced.setdefault(role, set()).add(step)
        self._wake.set()
        if not wait:
            return None
        deadline = time.monotonic() + timeout
        while True:
            newest = storage.newest_committed(directory)
            latest = storage.latest_step(directory)  # moved forward right after the rename
            with self._lock:
                committing = directory in self._committing
            if newest is not None and newest >= step and latest is not None and \
                    latest >= step and not committing:
                return newest
            if time.monotonic() > deadline:
                tmp = storage.tmp_dir(directory, step)
                have = sorted(n for n in (os.listdir(tmp) if os.path.isdir(tmp) else [])
                              if n.endswith(".done"))
                raise TimeoutError(
                    f"flash checkpoint step {step} of role {role!r} was not committed within "
                    f"{timeout:g} s: {len(have)} of {world} ranks written ({', '.join(have)}); "
                    f"failing: {self.failures.state()}; errors: {self.errors[-3:]}")
            time.sleep(0.05)

    def status(self) -> dict:
        """``pid``, ``current`` (the persist in progress: role, step, rank, bytes),
        ``history`` (finished persists), ``errors``, ``registered`` ranks, ``failing``
        (``None``, or what fails: ``{"what", "error", "since", "last", "tries",
        "retry_in_s"}``, times in unix seconds) and ``recovered`` (the last failing
        state that ended: ``{"what", "error", "since", "at", "tries"}``, or ``None``)."""
        with self._lock:
            return {"pid": self.pid, "current": dict(self.current) if self.current else None,
                    "history": list(self.history), "errors": list(self.errors),
                    "failing": self.failures.state(), "recovered": self.failures.recovered,
                    "registered": sorted(f"{r}-{k}" for r, k in self._regs),
                    "forced": {k: sorted(v) for k, v in self._forced.items()}}

    def finish(self, run_id: str | None = None, timeout: float = 300.0) -> dict:
        """The job ends: persist the newest step every local rank holds when it is not
        on disk yet, waiting up to ``timeout`` s for its commit (or, once this node's
        part is written, :data:`FINISH_GRACE_S` for the other nodes' ranks), stop the
        loop and remove the job's buffers on this node (those of ``run_id`` when
        given), except those holding a step newer than their directory's newest commit:
        they stay for the next run (:func:`hygiene.remove_job`, ``keep_unpersisted``).
        Returns ``{"flushed": {role: step}, "not_committed": [{"role", "step", "dir",
        "reason"}], "removed": [names], "not_persisted": [{"name", "role", "rank",
        "step", "dir", "shm_dir"}], "shm_dirs": [...], "errors": [...], "failing":
        status()["failing"]}``; a step of ``flushed`` that did not commit is listed
        under ``not_committed`` (and logged) with the reason."""
        flushed: dict[str, int] = {}
        with self._lock:
            roles = sorted({ro for ro, _ in self._regs})
            for role in roles:
                regs = [r for (ro, _), r in self._regs.items() if ro == role]
                common = self._common_steps(regs)
                newest = storage.newest_committed(regs[0].dir)
                if common and (newest is None or max(common) > newest):
                    flushed[role] = max(common)
                    self._forced.setdefault(role, set()).add(max(common))
        self._wake.set()
        deadline = time.monotonic() + timeout
        incomplete_since: float | None = None
        left: list[tuple[str, int]] = []
        while flushed and time.monotonic() < deadline and self._thread.is_alive():
            with self._lock:
                left = [(ro, st) for ro, st in flushed.items() if self._needs_persist(ro, st)]
                waiting = [(ro, st) for ro, st in left if not self._written_here(ro, st)]
            if not left:
                break
            if waiting or self.failures.state() or any(
                    storage.committable(self._reg_of(ro).dir, st, self._reg_of(ro).world_size)
                    for ro, st in left):
                incomplete_since = None  # writing, failing (backing off) or committing
            elif incomplete_since is None:
                incomplete_since = time.monotonic()
            elif time.monotonic() - incomplete_since > FINISH_GRACE_S:
                break  # written here; the other nodes' ranks do not come
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        not_committed = []
        with self._lock:
            for role, step in sorted(flushed.items()):
                if not self._needs_persist(role, step):
                    continue
                reg = self._reg_of(role)
                failing = self.failures.state()
                have = len([m for m in storage.read_markers(storage.tmp_dir(reg.dir, step))
                            if m.get("step") == step])
                reason = (f"persisting fails since {time.ctime(failing['since'])}: "
                          f"{failing['what']}: {failing['error']}" if failing else
                          f"{have} of {reg.world_size} ranks' files written")
                not_committed.append({"role": role, "step": step, "dir": reg.dir,
                                      "reason": reason})
                log.error("flash checkpoint step %d of %s was not committed at the job's "
                          "end: %s", step, role, reason)
            shm_dirs = {r.shm_dir for r in self._regs.values()} or {DEFAULT_SHM_DIR}
            for seg in list(self._segs.values()) + self._retired:
                seg.close()
            self._segs.clear()
            self._retired.clear()
        removed: list[str] = []
        kept: list[dict] = []
        for d in sorted(shm_dirs):
            removed += hygiene.remove_job(d, self.job, run_id, self.session,
                                          keep_unpersisted=True, kept=kept)
        return {"flushed": flushed, "not_committed": not_committed, "removed": removed,
                "not_persisted": kept, "shm_dirs": sorted(shm_dirs),
                "errors": list(self.errors), "failing": self.failures.state()}

    def _reg_of(self, role: str) -> Registration:
        return next(r for (ro, _), r in self._regs.items() if ro == role)

    def _written_here(self, role: str, step: int) -> bool:
        """Whether every local rank's save of ``step`` is written (or committed)."""
        regs = [r for (ro, _), r in self._regs.items() if ro == role]
        return self._pending(regs, step) in ([], None)


def remote_class() -> Any:
    import ray

    return ray.remote(FlashPersister)


def get_persister(job: str, create: bool = True, timeout: float = 120.0,
                  node_id: str | None = None, shm_dir: str = DEFAULT_SHM_DIR) -> Any:
    """The ready persister actor of ``job`` on this node (or on ``node_id``), created
    when missing and ``create``, or ``None``. A new persister first removes the stale
    buffers in ``shm_dir`` (the caller's ``checkpoint.options.shm_dir``; every other
    directory a rank registers is swept at its first registration). Call from a
    process connected to Ray (a worker of the job, or another persister).

    Raises:
        TimeoutError: no live persister could be had within ``timeout`` s.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node_id or ray.get_runtime_context().get_node_id()
    name = persister_name(job, node_id)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            if not create:
                return None
            env = crashpoint_env()  # a test or the crash-point harness arms it so
            handle = remote_class().options(
                **({"runtime_env": {"env_vars": env}} if env else {}), name=name,
                namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
                max_concurrency=16, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            ).remote(job, hygiene.current_session(), node_id, shm_dir)
        try:
            ray.get(handle.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return handle
        except ray.exceptions.RayActorError as exc:  # a dead one whose name is not free yet
            last = exc
            time.sleep(0.2)
    raise TimeoutError(f"no flash persister {name} within {timeout:g} s: {last}")


