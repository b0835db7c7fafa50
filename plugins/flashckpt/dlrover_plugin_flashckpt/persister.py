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

The actor is composed of parts, each an object with its own state
(docs/architecture.md, "The flash persister"): :class:`.node_ranks.NodeRanks` (the
registrations, the mappings of the ranks' buffers, the lock), :class:`.persisting.PersistLoop`
(the ``flash-persister`` thread: claim, write, release), :class:`.committer.Committer`
(the commit, in that thread), :class:`.replica.ReplicaSender` (the ``flash-replicate``
thread) and :class:`.replica.ReplicaHolder` (the replicas this node holds for its peer).
The actor's methods run in its call threads (``max_concurrency=16``); the functions
that find the persisters from outside are :mod:`.handles`'.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from dlrover_plugin_flashckpt import hygiene, shm, storage

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
from dlrover_plugin_flashckpt.node_ranks import NodeRanks
from dlrover_plugin_flashckpt.persisting import POLL_S, PersistLoop, Registration  # noqa: F401
from dlrover_plugin_flashckpt.replica import ReplicaHolder, ReplicaSender

log = logging.getLogger(__name__)

#: seconds :meth:`FlashPersister.finish` waits, once this node's part of a step is
#: written, for the other nodes' ranks that its commit needs
FINISH_GRACE_S = 10.0


class FlashPersister:
    """Ray actor (threaded): see the module docstring. Create through
    :func:`get_persister`."""

    def __init__(self, job: str, session: str, node_id: str,
                 shm_dir: str = DEFAULT_SHM_DIR) -> None:
        logging.basicConfig(level=logging.INFO)
        self.job = job
        self.session = session
        self.node_id = node_id
        self.pid, self.start = shm.my_identity()
        self.ranks = NodeRanks(job, self.pid, self.start)
        self.loop = PersistLoop(self.ranks)
        self.sender = ReplicaSender(self.ranks, node_id, self._peer, self.loop.error)
        self.holder = ReplicaHolder(self.ranks, job, session, node_id)
        self._lock = self.ranks.lock
        #: shared-memory directories already swept for stale buffers
        self._swept: set[str] = set()
        self.removed_stale = self._sweep(shm_dir)
        self.loop.thread.begin()
        self.sender.thread.begin()

    # ================================================================== actor API
    def ready(self) -> dict:
        """``pid``, ``node_id``, the stale buffers removed at start and ``ranks`` (how
        many ranks registered here: 0 on a node that only holds replicas)."""
        return {"pid": self.pid, "node_id": self.node_id, "removed_stale": self.removed_stale,
                "ranks": len(self.ranks.regs)}

    def saved(self, reg: dict, step: int | None = None) -> None:
        """A trainer saved (or just registered): remember its buffers, wake the loop."""
        r = Registration(**reg)
        if r.shm_dir not in self._swept:  # a directory first seen here: swept once
            self.removed_stale += self._sweep(r.shm_dir)
        self.ranks.register(r)
        self.loop.thread.wake()
        if r.replicas:
            self.sender.thread.wake()

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
            shm_dir = next((r.shm_dir for r in self.ranks.regs.values()), DEFAULT_SHM_DIR)
        return get_persister(self.job, node_id=node_id, shm_dir=shm_dir)

    # ------------------------------------------------------------ replicas (holder, sender)
    def store_replica(self, info: dict, data: Any) -> str:
        """:meth:`.replica.ReplicaHolder.store` (called by another node's persister)."""
        return self.holder.store(info, data)

    def replica_link(self, addr: tuple[str, int], token: bytes) -> bool:
        """:meth:`.replica.ReplicaHolder.open_link` (called by another node's persister)."""
        return self.holder.open_link(addr, token)

    def replicas(self, directory: str, shm_dir: str = "/dev/shm") -> dict:
        """:meth:`.replica.ReplicaHolder.listed`."""
        return self.holder.listed(directory, shm_dir)

    def read_replica(self, path: str, step: int) -> dict:
        """:meth:`.replica.ReplicaHolder.read` (for a trainer on another node)."""
        return self.holder.read(path, step)

    def replica_status(self) -> dict:
        """:meth:`.replica.ReplicaSender.status`."""
        return self.sender.status()

    def wait_replica(self, role: str, step: int, ranks: int = 1,
                     timeout: float = 60.0) -> list[dict]:
        """:meth:`.replica.ReplicaSender.wait` (blocks one of the actor's threads)."""
        return self.sender.wait(role, step, ranks, timeout)

    def held(self, role: str) -> dict:
        """Complete saves held in memory on this node for ``role``:
        ``{"world_size", "dir", "committed": newest committed step or None,
        "ranks": {rank: [steps]}}``."""
        with self._lock:
            regs = self.ranks.of_role(role)
            if not regs:
                return {"world_size": 0, "dir": "", "committed": None, "ranks": {}}
            out: dict[int, list[int]] = {}
            for r in regs:
                steps = []
                for path in r.slots:
                    seg = self.ranks.seg(path)
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
            claims = self.loop.claim(role, step)
            self.loop.force(role, step)
        self.loop.thread.wake()
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
            regs = self.ranks.of_role(role)
            if not regs:
                return None
            directory, world = regs[0].dir, regs[0].world_size
            if step is None:
                common = self.ranks.common_steps(regs)
                if not common:
                    return storage.newest_committed(directory)
                step = max(common)
            self.loop.force(role, step)
        self.loop.thread.wake()
        if not wait:
            return None
        deadline = time.monotonic() + timeout
        while True:
            newest = storage.newest_committed(directory)
            latest = storage.latest_step(directory)  # moved forward right after the rename
            committing = self.loop.committer.is_committing(directory)
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
                    f"failing: {self.loop.failures.state()}; errors: {self.loop.errors[-3:]}")
            time.sleep(0.05)

    def status(self) -> dict:
        """``pid``, ``current`` (the persist in progress: role, step, rank, bytes),
        ``history`` (finished persists: ``role``, ``step``, ``ranks`` written,
        ``committed``, ``seconds`` from the claim to the end of the commit try and
        ``write_seconds`` until the files were written and fsynced), ``errors``,
        ``registered`` ranks, ``failing``
        (``None``, or what fails: ``{"what", "error", "since", "last", "tries",
        "retry_in_s"}``, times in unix seconds) and ``recovered`` (the last failing
        state that ended: ``{"what", "error", "since", "at", "tries"}``, or ``None``)."""
        with self._lock:
            loop = self.loop
            return {"pid": self.pid, "current": dict(loop.current) if loop.current else None,
                    "history": list(loop.history), "errors": list(loop.errors),
                    "failing": loop.failures.state(), "recovered": loop.failures.recovered,
                    "registered": sorted(f"{r}-{k}" for r, k in self.ranks.regs),
                    "forced": {k: sorted(v) for k, v in loop.forced.items()}}

    def finish(self, run_id: str | None = None, timeout: float = 300.0,
               grace_s: float = FINISH_GRACE_S) -> dict:
        """The job ends: persist the newest step every local rank holds when it is not
        on disk yet, waiting up to ``timeout`` s for its commit (or, once this node's
        part is written, ``grace_s`` s for the other nodes' ranks), stop the
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
            for role in self.ranks.roles():
                regs = self.ranks.of_role(role)
                common = self.ranks.common_steps(regs)
                newest = storage.newest_committed(regs[0].dir)
                if common and (newest is None or max(common) > newest):
                    flushed[role] = max(common)
                    self.loop.force(role, max(common))
        self.loop.thread.wake()
        deadline = time.monotonic() + timeout
        incomplete_since: float | None = None
        left: list[tuple[str, int]] = []
        while flushed and time.monotonic() < deadline and self.loop.thread.alive():
            with self._lock:
                left = [(ro, st) for ro, st in flushed.items() if self.ranks.needs_persist(ro, st)]
                waiting = [(ro, st) for ro, st in left if not self.ranks.written_here(ro, st)]
            if not left:
                break
            if waiting or self.loop.failures.state() or any(
                    storage.committable(self.ranks.reg_of(ro).dir, st,
                                        self.ranks.reg_of(ro).world_size)
                    for ro, st in left):
                incomplete_since = None  # writing, failing (backing off) or committing
            elif incomplete_since is None:
                incomplete_since = time.monotonic()
            elif time.monotonic() - incomplete_since > grace_s:
                break  # written here; the other nodes' ranks do not come
            time.sleep(0.05)
        self.sender.thread.end(timeout=0)
        self.loop.thread.end(timeout=max(1.0, deadline - time.monotonic()))
        not_committed = []
        with self._lock:
            for role, step in sorted(flushed.items()):
                if not self.ranks.needs_persist(role, step):
                    continue
                reg = self.ranks.reg_of(role)
                failing = self.loop.failures.state()
                have = len([m for m in storage.read_markers(storage.tmp_dir(reg.dir, step))
                            if m.get("step") == step])
                reason = (f"persisting fails since {time.ctime(failing['since'])}: "
                          f"{failing['what']}: {failing['error']}" if failing else
                          f"{have} of {reg.world_size} ranks' files written")
                not_committed.append({"role": role, "step": step, "dir": reg.dir,
                                      "reason": reason})
                log.error("flash checkpoint step %d of %s was not committed at the job's "
                          "end: %s", step, role, reason)
            shm_dirs = {r.shm_dir for r in self.ranks.regs.values()} or {DEFAULT_SHM_DIR}
            self.ranks.close_all()
        self.holder.close()
        removed: list[str] = []
        kept: list[dict] = []
        for d in sorted(shm_dirs):
            removed += hygiene.remove_job(d, self.job, run_id, self.session,
                                          keep_unpersisted=True, kept=kept)
        return {"flushed": flushed, "not_committed": not_committed, "removed": removed,
                "not_persisted": kept, "shm_dirs": sorted(shm_dirs),
                "errors": list(self.loop.errors), "failing": self.loop.failures.state()}


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


