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
   release the slots (READY, with the data crc32 and ``persisted_seq`` recorded);
4. commit when every rank of the role is written (``storage.try_commit``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from dlrover_plugin_flashckpt import hygiene, shm, storage

log = logging.getLogger(__name__)

NAMESPACE = "dlrover"
POLL_S = 0.5
#: where buffers are looked for at job end when no saver said otherwise
DEFAULT_SHM_DIR = "/dev/shm"


def persister_name(job: str, node_id: str) -> str:
    return f"dlrover-flash-{job}-{node_id[:16]}"


@dataclass
class Registration:
    """What a trainer's saver tells its persister (sent with every notification).

    Attributes: role, rank, world_size, dir (the role's checkpoint directory), keep,
    slots (paths of the rank's buffers), persist_every_steps, throttle_mib_s, run_id,
    shm_dir.
    """

    role: str
    rank: int
    world_size: int
    dir: str
    keep: int
    slots: list[str]
    persist_every_steps: int = 1
    throttle_mib_s: float = 0.0
    run_id: str = ""
    shm_dir: str = "/dev/shm"
    replicas: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class _Claim:
    rank: int
    seg: shm.Segment
    seq: int


class FlashPersister:
    """Ray actor (threaded): see the module docstring. Create through
    :func:`get_persister`."""

    def __init__(self, job: str, session: str, node_id: str) -> None:
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
        self.current: dict | None = None
        self.history: list[dict] = []
        self.errors: list[str] = []
        self.removed_stale = hygiene.remove_stale("/dev/shm", session)
        #: (role, rank) -> (step, seq) of the last save replicated to the peer
        self._replicated: dict[tuple[str, int], tuple[int, int]] = {}
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

    # ------------------------------------------------------------------ replicas
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

    def _allowed_replica(self, path: str) -> str:
        """``path`` when it names a replica buffer of this job in an allowed shared-
        memory directory.

        Raises:
            ValueError: any other path."""
        from dlrover_plugin_flashckpt import replica

        name = os.path.basename(path) if isinstance(path, str) else ""
        try:
            self._allowed_shm_dir(os.path.dirname(path))
        except (ValueError, TypeError):
            raise ValueError(f"flash persister of job {self.job!r}: replica path {path!r} "
                             "is not in an allowed shared-memory directory") from None
        if not name.startswith(shm.job_prefix(self.job)) or replica.parse_replica(name) is None:
            raise ValueError(f"flash persister of job {self.job!r}: {path!r} is not a replica "
                             f"buffer of this job (names start {shm.job_prefix(self.job)!r})")
        return path

    def store_replica(self, info: dict, data: Any) -> str:
        """Hold a replica of another node's save (called by that node's persister;
        ``data`` arrives through Ray's object transfer). Returns the buffer name.

        Raises:
            ValueError: ``info["dir"]`` or ``info["shm_dir"]`` is not this job's."""
        from dlrover_plugin_flashckpt import replica

        self._allowed_dir(info.get("dir"))
        self._allowed_shm_dir(info.get("shm_dir", "/dev/shm"))
        ident = {"job": self.job, "role": info.get("role", ""), "rank": info["rank"],
                 "world_size": info["world_size"], "dir": info["dir"], "session": self.session,
                 "run_id": info.get("run_id", ""), "replica_of": info.get("source", "")}
        return replica.store(info.get("shm_dir", "/dev/shm"), self.job, self.node_id, info,
                             data, ident)

    def replicas(self, directory: str, shm_dir: str = "/dev/shm") -> dict:
        """Replicas of ``directory`` held on this node: ``{"node_id", "held": [{"name",
        "path", "rank", "world_size", "step", "bytes"}]}``."""
        from dlrover_plugin_flashckpt import replica

        if not isinstance(directory, str) or not os.path.isabs(directory):
            raise ValueError(f"replicas: directory {directory!r} is not an absolute path")
        self._allowed_shm_dir(shm_dir)  # listed; ``directory`` is only compared
        return {"node_id": self.node_id,
                "held": replica.held(shm_dir, self.job, directory, self.node_id)}

    def read_replica(self, path: str, step: int) -> dict:
        """The bytes of a replica held here (for a trainer on another node):
        ``{"meta", "data" (numpy uint8), "step"}``.

        Raises:
            ValueError: it no longer holds ``step``, or ``path`` is not a replica
                buffer of this job."""
        from dlrover_plugin_flashckpt import replica

        return replica.read(self._allowed_replica(path), step)

    def replica_status(self) -> dict:
        with self._lock:
            return {"replicated": {f"{k[0]}-{k[1]}": v for k, v in self._replicated.items()},
                    "history": list(self.replica_history)}

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
        is committed and return the newest committed step. ``reg``: the caller's
        registration (calls of a threaded actor may run out of order, so a ``saved``
        sent just before may not have run yet).

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
            if newest is not None and newest >= step and latest is not None and latest >= step:
                return newest
            if time.monotonic() > deadline:
                tmp = storage.tmp_dir(directory, step)
                have = sorted(n for n in (os.listdir(tmp) if os.path.isdir(tmp) else [])
                              if n.endswith(".done"))
                raise TimeoutError(
                    f"flash checkpoint step {step} of role {role!r} was not committed within "
                    f"{timeout:g} s: {len(have)} of {world} ranks written ({', '.join(have)}); "
                    f"errors: {self.errors[-3:]}")
            time.sleep(0.05)

    def status(self) -> dict:
        """``pid``, ``current`` (the persist in progress: role, step, rank, bytes),
        ``history`` (finished persists), ``errors`` and ``registered`` ranks."""
        with self._lock:
            return {"pid": self.pid, "current": dict(self.current) if self.current else None,
                    "history": list(self.history), "errors": list(self.errors),
                    "registered": sorted(f"{r}-{k}" for r, k in self._regs),
                    "forced": {k: sorted(v) for k, v in self._forced.items()}}

    def finish(self, run_id: str | None = None, timeout: float = 300.0) -> dict:
        """The job ends: persist the newest step every local rank holds when it is not
        on disk yet (waiting up to ``timeout`` s for this node's part), stop the loop
        and remove the job's buffers on this node (those of ``run_id`` when given),
        except those holding a step newer than their directory's newest commit: they
        stay for the next run (:func:`hygiene.remove_job`, ``keep_unpersisted``).
        Returns ``{"flushed": {role: step}, "removed": [names], "not_persisted": [{"name",
        "role", "rank", "step", "dir"}], "shm_dirs": [...], "errors": [...]}``."""
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
        while flushed and time.monotonic() < deadline and self._thread.is_alive():
            with self._lock:
                left = any(self._needs_persist(role, step) for role, step in flushed.items())
            if not left:
                break
            time.sleep(0.05)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=max(1.0, deadline - time.monotonic()))
        with self._lock:
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
        return {"flushed": flushed, "removed": removed, "not_persisted": kept,
                "shm_dirs": sorted(shm_dirs), "errors": list(self.errors)}

    # ================================================================== internals
    def _seg(self, path: str) -> shm.Segment | None:
        seg = self._segs.get(path)
        if seg is not None and seg.replaced():
            self._retired.append(self._segs.pop(path))
            seg = None
        if seg is None:
            seg = shm.Segment.attach(path)
            if seg is not None:
                self._segs[path] = seg
        return seg

    def _stamp(self, seg: shm.Segment) -> None:
        """Record this process as the buffer's persister (for staleness and claims)."""
        h = seg.read_header()
        if (h.persister_pid, h.persister_start) != (self.pid, self.start):
            with seg.locked():
                h = seg.read_header()
                h.persister_pid, h.persister_start = self.pid, self.start
                seg.write_header(h)

    def _rank_steps(self, r: Registration, pending_only: bool) -> dict[int, tuple[shm.Segment, shm.Header]]:
        out: dict[int, tuple[shm.Segment, shm.Header]] = {}
        for path in r.slots:
            seg = self._seg(path)
            if seg is None:
                continue
            h = seg.read_header()
            if not shm.holds_step(h):
                continue
            if pending_only and h.persisted_seq == h.seq:
                continue
            if h.step not in out or out[h.step][1].seq < h.seq:
                out[h.step] = (seg, h)
        return out

    def _common_steps(self, regs: list[Registration], pending_only: bool = False) -> set[int]:
        common: set[int] | None = None
        for r in regs:
            steps = set(self._rank_steps(r, pending_only))
            common = steps if common is None else common & steps
        return common or set()

    def _pending(self, regs: list[Registration], step: int) -> list[shm.Header] | None:
        """Headers of the local ranks whose save of ``step`` is not written yet, or
        ``None`` when some local rank does not hold ``step``."""
        out = []
        for r in regs:
            found = self._rank_steps(r, pending_only=False).get(step)
            if found is None:
                return None
            if found[1].persisted_seq != found[1].seq:
                out.append(found[1])
        return out

    def _needs_persist(self, role: str, step: int) -> bool:
        regs = [r for (ro, _), r in self._regs.items() if ro == role]
        newest = storage.newest_committed(regs[0].dir) if regs else None
        if newest is not None and newest >= step:
            return False
        return bool(self._pending(regs, step))

    def _claim(self, role: str, step: int) -> list[_Claim]:
        """Mark every local rank's slot holding ``step`` PERSISTING; all or nothing."""
        regs = sorted((r for (ro, _), r in self._regs.items() if ro == role),
                      key=lambda r: r.rank)
        claims: list[_Claim] = []
        for r in regs:
            found = self._rank_steps(r, pending_only=True).get(step)
            if found is None:
                continue
            seg, _ = found
            with seg.locked():
                h = seg.read_header()
                mine = h.state == shm.PERSISTING and (h.persister_pid, h.persister_start) == (
                    self.pid, self.start)
                if h.step != step or not (shm.holds_step(h) or mine):
                    continue
                h.state = shm.PERSISTING
                h.persister_pid, h.persister_start = self.pid, self.start
                seg.write_header(h)
                claims.append(_Claim(r.rank, seg, h.seq))
        return claims

    def _release(self, claims: list[_Claim], results: dict[int, dict]) -> None:
        """Give the claimed slots back (READY); those written (``results``) count as
        persisted."""
        for c in claims:
            with c.seg.locked():
                h = c.seg.read_header()
                if h.seq != c.seq or h.state != shm.PERSISTING:
                    continue
                h.state = shm.READY
                if c.rank in results:
                    data_name, _ = storage.rank_files(c.rank)
                    h.data_crc = results[c.rank]["files"][data_name]["crc32"]
                    h.crc_seq = h.persisted_seq = c.seq
                c.seg.write_header(h)

    def _retire_obsolete(self, regs: list[Registration], newest: int | None) -> None:
        """Mark saves at or below the newest committed step as persisted: they will
        never be written, and a save must not keep them as "waiting for the disk"."""
        if newest is None:
            return
        for r in regs:
            for path in r.slots:
                seg = self._seg(path)
                if seg is None:
                    continue
                h = seg.read_header()
                if h.state != shm.READY or h.persisted_seq == h.seq or h.step > newest:
                    continue
                with seg.locked():
                    h = seg.read_header()
                    if h.state == shm.READY and h.step <= newest:
                        h.persisted_seq = h.seq
                        seg.write_header(h)

    def _pick(self) -> tuple[str, int] | None:
        """The next (role, step) to persist, or ``None``."""
        roles = sorted({ro for ro, _ in self._regs})
        best: tuple[tuple, str, int] | None = None
        for role in roles:
            regs = [r for (ro, _), r in self._regs.items() if ro == role]
            newest = storage.newest_committed(regs[0].dir)
            self._retire_obsolete(regs, newest)
            forced = self._forced.get(role, set())
            if newest is not None:
                forced.difference_update({s for s in forced if s <= newest})
            started = set(storage.pending_tmp_steps(regs[0].dir))
            for step in self._common_steps(regs):
                if newest is not None and step <= newest:
                    continue
                pending = self._pending(regs, step)
                if not pending:
                    continue
                if not (all(h.due for h in pending) or step in forced):
                    continue
                key = (step in forced, step in started, step)
                if best is None or key > best[0]:
                    best = (key, role, step)
        return None if best is None else (best[1], best[2])

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(POLL_S)
            self._wake.clear()
            try:
                with self._lock:
                    for seg in self._retired:
                        seg.close()
                    self._retired.clear()
                while not self._stop.is_set() and self._persist_one():
                    pass
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                self._error(f"persister loop: {type(exc).__name__}: {exc}\n"
                            + traceback.format_exc(limit=5))

    def _replicate_loop(self) -> None:
        while not self._stop.is_set():
            self._repl_wake.wait(POLL_S * 4)
            self._repl_wake.clear()
            try:
                while not self._stop.is_set() and self._replicate_one():
                    pass
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                self._error(f"replication: {type(exc).__name__}: {exc}\n"
                            + traceback.format_exc(limit=5))

    def _replicate_one(self) -> bool:
        """Copy one rank's newest save not replicated yet to the peer node; True when
        there was one (replicated or dropped)."""
        import ray

        from dlrover_plugin_flashckpt import replica

        todo = None
        with self._lock:
            for (role, rank), r in sorted(self._regs.items()):
                if not r.replicas:
                    continue
                steps = self._rank_steps(r, pending_only=False)
                if not steps:
                    continue
                step = max(steps)
                seg, h = steps[step]
                if self._replicated.get((role, rank)) != (step, h.seq):
                    todo = (r, seg, h)
                    break
        if todo is None:
            return False
        r, seg, h = todo
        peer = replica.peer_of(self.node_id, _alive_nodes())
        if peer is None:
            with self._lock:
                self._replicated[(r.role, r.rank)] = (h.step, h.seq)
            log.warning("flash replica of %s rank %d step %d: no other node", r.role, r.rank,
                        h.step)
            return True
        t0 = time.monotonic()
        import numpy as np

        meta = seg.meta_bytes(h)
        ref = ray.put(np.frombuffer(seg.mm, dtype=np.uint8, count=h.data_len,
                                    offset=h.data_offset))
        again = seg.read_header()
        if again.seq != h.seq or not shm.holds_step(again):
            log.info("flash replica of %s rank %d step %d dropped: overwritten while copied",
                     r.role, r.rank, h.step)
            return True  # the newer save is replicated next
        info = {"dir": r.dir, "role": r.role, "rank": r.rank, "world_size": r.world_size,
                "step": h.step, "meta": meta, "data_len": h.data_len, "saved_at": h.saved_at,
                "run_id": r.run_id, "shm_dir": r.shm_dir, "source": self.node_id}
        holder = get_persister(self.job, node_id=peer)
        name = ray.get(holder.store_replica.remote(info, ref), timeout=600)
        del ref
        with self._lock:
            self._replicated[(r.role, r.rank)] = (h.step, h.seq)
            self.replica_history.append({"role": r.role, "rank": r.rank, "step": h.step,
                                         "peer": peer, "name": name, "bytes": h.data_len,
                                         "seconds": round(time.monotonic() - t0, 4),
                                         "done_at": time.time()})
            del self.replica_history[:-50]
        return True

    def _error(self, msg: str) -> None:
        log.error(msg)
        with self._lock:
            self.errors.append(msg)
            del self.errors[:-20]

    def _release_other_claims(self, keep: tuple[str, int] | None) -> None:
        """Give back this process's claims except those on ``keep`` (role, step): a
        breakpoint claim whose step got committed elsewhere must not pin a slot."""
        for r in list(self._regs.values()):
            for path in r.slots:
                seg = self._seg(path)
                if seg is None:
                    continue
                h = seg.read_header()
                if h.state != shm.PERSISTING or (r.role, h.step) == keep or \
                        (h.persister_pid, h.persister_start) != (self.pid, self.start):
                    continue
                with seg.locked():
                    h = seg.read_header()
                    if h.state == shm.PERSISTING and (r.role, h.step) != keep:
                        h.state = shm.READY
                        seg.write_header(h)

    def _persist_one(self) -> bool:
        with self._lock:
            picked = self._pick()
            self._release_other_claims(picked)
            if picked is None:
                return False
            role, step = picked
            claims = self._claim(role, step)
            regs = {r.rank: r for (ro, _), r in self._regs.items() if ro == role}
        if not claims:
            return False
        results: dict[int, dict] = {}
        attempts: list[dict] = []
        t0 = time.monotonic()
        first = regs[claims[0].rank]
        try:
            throttle = storage.Throttle(first.throttle_mib_s * 2**20)
            for c in claims:
                reg = regs[c.rank]
                h = c.seg.read_header()
                with self._lock:
                    self.current = {"role": role, "step": step, "rank": c.rank, "bytes": 0,
                                    "total": h.data_len}

                def progress(n: int) -> None:
                    if self.current is not None:
                        self.current["bytes"] += n

                meta = c.seg.meta_bytes(h)
                # the attempt that made this save (a trailer of its meta block); a save
                # without one (an older saver) counts as run id + world size only
                attempt = storage.meta_attempt(meta) or storage.make_attempt(
                    reg.run_id, reg.world_size)
                attempts.append(attempt)
                with c.seg.data_view(h) as data:
                    results[c.rank] = storage.write_shard(
                        reg.dir, step, c.rank, reg.world_size, meta, data,
                        extra={"seq": c.seq, "saved_at": h.saved_at}, throttle=throttle,
                        progress=progress, attempt=attempt)
        except Exception as exc:  # noqa: BLE001
            self._error(f"persisting {role} step {step} failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._release(claims, results)
                self.current = None
        committed = False
        if len(results) == len(claims):
            try:
                committed = storage.try_commit(first.dir, step, first.world_size, first.keep,
                                               attempt=attempts[0])
            except Exception as exc:  # noqa: BLE001
                self._error(f"committing {role} step {step} failed: {type(exc).__name__}: {exc}")
        with self._lock:
            if committed:
                self._forced.get(role, set()).discard(step)
            self.history.append({"role": role, "step": step, "ranks": sorted(results),
                                 "committed": committed,
                                 "seconds": round(time.monotonic() - t0, 4)})
            del self.history[:-50]
        return True


def remote_class() -> Any:
    import ray

    return ray.remote(FlashPersister)


def get_persister(job: str, create: bool = True, timeout: float = 120.0,
                  node_id: str | None = None) -> Any:
    """The ready persister actor of ``job`` on this node (or on ``node_id``), created
    when missing and ``create``, or ``None``. Call from a process connected to Ray (a
    worker of the job, or another persister).

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
            handle = remote_class().options(
                name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_concurrency=16, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            ).remote(job, hygiene.current_session(), node_id)
        try:
            ray.get(handle.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return handle
        except ray.exceptions.RayActorError as exc:  # a dead one whose name is not free yet
            last = exc
            time.sleep(0.2)
    raise TimeoutError(f"no flash persister {name} within {timeout:g} s: {last}")


def _alive_nodes() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def persisters_of(job: str) -> dict[str, Any]:
    """``node_id -> handle`` of the live persisters of ``job``."""
    import ray

    out = {}
    for node in _alive_nodes():
        try:
            out[node] = ray.get_actor(persister_name(job, node), namespace=NAMESPACE)
        except ValueError:
            pass
    return out


def breakpoint_save(job: str, role: str, timeout: float = 30.0) -> dict:
    """A trainer of ``role`` died: persist the newest step that every rank of the role
    holds in memory and that is not committed yet. Two phases over the job's
    persisters on every node: ask what they hold, then claim that step everywhere
    (the writing goes on in the background). Returns ``{"step": step or None,
    "claimed": {node: [ranks]}, "reason": str}``."""
    import ray

    handles = persisters_of(job)
    if not handles:
        return {"step": None, "claimed": {}, "reason": "no flash persister for this job"}
    answers = dict(zip(handles, ray.get([h.held.remote(role) for h in handles.values()],
                                        timeout=timeout)))
    world = max((a["world_size"] for a in answers.values()), default=0)
    ranks: dict[int, set[int]] = {}
    committed = None
    for a in answers.values():
        for r, steps in a["ranks"].items():
            ranks.setdefault(int(r), set()).update(steps)
        if a["committed"] is not None:
            committed = max(committed or -1, a["committed"])
    if world == 0 or len(ranks) < world:
        return {"step": None, "claimed": {},
                "reason": f"{len(ranks)} of {world} ranks of {role!r} hold a save in memory"}
    common = set.intersection(*ranks.values())
    candidates = [s for s in common if committed is None or s > committed]
    if not candidates:
        return {"step": None, "claimed": {},
                "reason": f"no step newer than the committed {committed} on every rank"}
    step = max(candidates)
    claimed = dict(zip(handles, ray.get([h.breakpoint.remote(role, step)
                                         for h in handles.values()], timeout=timeout)))
    return {"step": step, "claimed": claimed, "reason": "persisting"}


def finish_job(job: str, run_id: str | None = None, timeout: float = 300.0,
               shm_dirs: list[str] | None = None) -> dict:
    """End of ``job``: on every alive node, flush and stop the job's persister (waiting
    at most ``timeout`` s for it) and remove the job's buffers (of ``run_id`` when
    given) in the shared-memory directories its savers registered, except buffers
    holding a step newer than the newest commit, which stay (listed under
    ``not_persisted``); returns ``{node: report}`` (see :meth:`FlashPersister.finish`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, max_retries=0)
    def _finish_node(job: str, run_id: str | None, timeout: float,
                     shm_dirs: list[str] | None) -> dict:
        node = ray.get_runtime_context().get_node_id()
        report: dict = {"flushed": {}, "removed": [], "not_persisted": [], "errors": []}
        try:
            handle = ray.get_actor(persister_name(job, node), namespace=NAMESPACE)
        except ValueError:
            handle = None
        if handle is not None:
            try:
                report = ray.get(handle.finish.remote(run_id, timeout), timeout=timeout + 5)
            except Exception as exc:  # noqa: BLE001 - stuck or dead: its buffers stay
                report["errors"].append(f"persister: {type(exc).__name__}: {exc}")
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        kept: list[dict] = []
        for d in report.get("shm_dirs") or shm_dirs or [DEFAULT_SHM_DIR]:
            report["removed"] = report.get("removed", []) + hygiene.remove_job(
                d, job, run_id, hygiene.current_session(), keep_unpersisted=True, kept=kept)
        report["not_persisted"] = kept  # what is left now, after the persister's part
        return report

    nodes = _alive_nodes()
    refs = [_finish_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=n, soft=False)).remote(job, run_id, timeout, shm_dirs) for n in nodes]
    out = {}
    for n, ref in zip(nodes, refs):
        try:
            out[n] = ray.get(ref, timeout=timeout + 60)
        except Exception as exc:  # noqa: BLE001
            out[n] = {"errors": [f"{type(exc).__name__}: {exc}"]}
    return out
