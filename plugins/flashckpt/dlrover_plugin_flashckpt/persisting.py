"""The persist loop of the per-node persister (:class:`PersistLoop`), in the
persister actor's process: pick the next step, claim its slots, write the local
ranks' files, release, commit (:class:`.committer.Committer`). Imports no torch.

It owns the ``flash-persister`` thread (one persist at a time per node), the steps
forced ahead of the schedule (breakpoint, ``wait()``, job end), the persist in
progress, the history, the errors and the failure state (:mod:`.failures`). It
claims the slots of the :class:`.node_ranks.NodeRanks` (PERSISTING) under each
buffer's header lock and writes the step's files (:func:`.storage.write_shard`);
its bookkeeping is guarded by the lock of the ``NodeRanks``.

Order: per role, the steps that every local rank holds in a READY slot, not yet
written, and due (``persist_every_steps``) or forced (breakpoint, ``wait()``, job
end); forced steps first, then steps another node already started, then the newest.
When nothing is to be written, the commit of a step whose files are written but not
committed (another node's ranks came later, or a commit was interrupted: a kill,
``ENOSPC``, a lock lost) is tried again (:meth:`.committer.Committer.candidates`).

A save counts as persisted (``persisted_seq``) only once its step (or a newer one of
the lineage) is committed; a save whose files are in the temp directory (a marker, or
a commit's intent: :func:`.storage.written_saves`) is not written again. A failure is
retried after a backoff (:mod:`.failures`); the status says that persisting fails.
"""

from __future__ import annotations

import logging
import time
import traceback

from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import shm, storage
from dlrover_plugin_flashckpt.failures import PersistFailures
from dlrover_plugin_flashckpt.loopthread import LoopThread

from dlrover_plugin_flashckpt.committer import Committer
from dlrover_plugin_flashckpt.node_ranks import NodeRanks

# re-exported: the persister and the tests reach the registration through this module
from dlrover_plugin_flashckpt.registration import (  # noqa: F401
    Claim,
    Registration,
    save_attempt,
)

log = logging.getLogger("dlrover_plugin_flashckpt.persister")

POLL_S = 0.5

declare("flash.persist.claim", "state", "persist",
        "the persister marked a rank's slot PERSISTING (claimed it)")
declare("flash.persist.release", "state", "persist",
        "the persister gave a claimed slot back (READY, its files written or not)")


class PersistLoop:
    """The persist loop of one node (see the module docstring).

    Args:
        ranks: the node's registrations and buffers (and the lock).
    """

    def __init__(self, ranks: NodeRanks) -> None:
        self.ranks = ranks
        self.pid, self.start = ranks.pid, ranks.start
        self._lock = ranks.lock
        #: role -> steps persisted next, whether due or not
        self.forced: dict[str, set[int]] = {}
        #: the persist in progress: role, step, rank, bytes, total
        self.current: dict | None = None
        #: finished persists (the last 50)
        self.history: list[dict] = []
        #: the last 20 errors
        self.errors: list[str] = []
        #: failures in a row of the persist loop, and its backoff
        self.failures = PersistFailures()
        self.committer = Committer(ranks, self.failures, self._failed, self._landed)
        #: the ``flash-persister`` thread (woken by a save, a forced step)
        self.thread = LoopThread("flash-persister", self._loop)

    def force(self, role: str, step: int) -> None:
        """Persist ``step`` of ``role`` next, even when not due (call under the lock)."""
        self.forced.setdefault(role, set()).add(step)

    def _landed(self, role: str, step: int) -> None:
        self.forced.get(role, set()).discard(step)

    def claim(self, role: str, step: int) -> list[Claim]:
        """Mark every local rank's slot holding ``step`` PERSISTING, unless ``step`` is
        committed; all or nothing."""
        regs = sorted(self.ranks.of_role(role),
                      key=lambda r: r.rank)
        claims: list[Claim] = []
        written = storage.written_saves(regs[0].dir, step) if regs else set()
        # read after the temp directory: a commit by another node's persister that
        # consumed this rank's marker (and renamed the directory) since the step was
        # picked shows here, so the step is not written again after its commit (a
        # temp directory of the newest step left behind: the chaos run, seed 14)
        newest = storage.newest_committed(regs[0].dir) if regs else None
        if newest is not None and step <= newest:
            return claims
        for r in regs:
            found = self.ranks.rank_steps(r, pending_only=True).get(step)
            if found is None or (r.rank, found[1].seq, found[1].saved_at) in written:
                continue
            seg, _ = found
            with seg.locked():
                h = seg.read_header()
                mine = h.state == shm.PERSISTING and (h.persister_pid, h.persister_start) == (
                    self.pid, self.start)
                if h.step != step or not (shm.holds_step(h) or mine) \
                        or (h.rank, h.world_size) != (r.rank, r.world_size):
                    continue
                h.state = shm.PERSISTING
                h.persister_pid, h.persister_start = self.pid, self.start
                seg.write_header(h)
                crashpoint("flash.persist.claim", path=seg.path)
                claims.append(Claim(r.rank, seg, h.seq))
        return claims

    def _release(self, claims: list[Claim], results: dict[int, dict]) -> None:
        """Give the claimed slots back (READY); for those written (``results``), the
        data crc32 is recorded (``crc_seq``); they count as persisted only once the
        step is committed (:meth:`.committer.Committer.retire`)."""
        for c in claims:
            with c.seg.locked():
                h = c.seg.read_header()
                if h.seq != c.seq or h.state != shm.PERSISTING:
                    continue
                h.state = shm.READY
                if c.rank in results:
                    data_name, _ = storage.rank_files(c.rank)
                    h.data_crc = results[c.rank]["files"][data_name]["crc32"]
                    h.crc_seq = c.seq
                c.seg.write_header(h)
                crashpoint("flash.persist.release", path=c.seg.path)

    def _pick(self) -> tuple[str, int] | None:
        """The next (role, step) to persist, or ``None``."""
        roles = self.ranks.roles()
        best: tuple[tuple, str, int] | None = None
        for role in roles:
            regs = self.ranks.of_role(role)
            lineage, newest = storage.newest_with_lineage(regs[0].dir)
            self.committer.retire(regs, lineage, newest)
            forced = self.forced.get(role, set())
            if newest is not None:
                forced.difference_update({s for s in forced if s <= newest})
            started = set(storage.pending_tmp_steps(regs[0].dir))
            for step in self.ranks.common_steps(regs):
                if newest is not None and step <= newest:
                    continue
                pending = self.ranks.pending(regs, step)
                if not pending:
                    continue
                if not (all(h.due for h in pending) or step in forced):
                    continue
                key = (step in forced, step in started, step)
                if best is None or key > best[0]:
                    best = (key, role, step)
        return None if best is None else (best[1], best[2])

    def _loop(self) -> None:
        while not self.thread.stopping:
            self.thread.pause(self.failures.wait_s(POLL_S))
            if not self.failures.due():
                continue  # backing off after a failure: a save's wake-up is no retry
            try:
                self.ranks.close_retired()
                while not self.thread.stopping and self.failures.due() \
                        and self._persist_one():
                    pass
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                self._failed("the persister loop", exc, traceback.format_exc(limit=5))

    def error(self, msg: str) -> None:
        log.error(msg)
        with self._lock:
            self.errors.append(msg)
            del self.errors[:-20]

    def _failed(self, what: str, exc: BaseException, detail: str = "",
                where: tuple[str, int] | None = None) -> None:
        """A persist or commit (of ``where``: directory, step) failed: back off; keep
        the first error of a kind in a row (the later ones are counted)."""
        msg = self.failures.failed(what, exc, where)
        if msg is not None:
            with self._lock:
                self.errors.append(msg + ("\n" + detail if detail else ""))
                del self.errors[:-20]

    def _release_other_claims(self, keep: tuple[str, int] | None) -> None:
        """Give back this process's claims except those on ``keep`` (role, step): a
        breakpoint claim whose step got committed elsewhere must not pin a slot."""
        for r in list(self.ranks.regs.values()):
            for path in r.slots:
                seg = self.ranks.seg(path)
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
        """Write the next step's local files and try its commit, or else try the
        commit of a step written but not committed. True when it got on (the loop goes
        on at once); False when there was nothing to do or it failed (the loop waits
        :data:`POLL_S`, or the backoff)."""
        with self._lock:
            picked = self._pick()
            self._release_other_claims(picked)
            if picked is None:
                todo = self.committer.candidates()
            else:
                role, step = picked
                claims = self.claim(role, step)
                regs = {r.rank: r for r in self.ranks.of_role(role)}
        if picked is None:
            for c in todo:
                done = self.committer.commit(*c)
                if done is not False:
                    return bool(done)  # landed: go on; failed (None): back off
            self.committer.check_recovered()
            return False
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
                attempt = save_attempt(meta, reg)
                attempts.append(attempt)
                with c.seg.data_view(h) as data:
                    results[c.rank] = storage.write_shard(
                        reg.dir, step, c.rank, reg.world_size, meta, data,
                        extra={"seq": c.seq, "saved_at": h.saved_at}, throttle=throttle,
                        progress=progress, attempt=attempt)
        except Exception as exc:  # noqa: BLE001
            self._failed(f"persisting {role} step {step}", exc, where=(first.dir, step))
        finally:
            with self._lock:
                self._release(claims, results)
                self.current = None
        written_s = time.monotonic() - t0
        committed = None
        if len(results) == len(claims):
            committed = self.committer.commit(role, step, first, attempts[0])
        with self._lock:
            self.history.append({"role": role, "step": step, "ranks": sorted(results),
                                 "committed": bool(committed),
                                 "seconds": round(time.monotonic() - t0, 4),
                                 "write_seconds": round(written_s, 4)})
            del self.history[:-50]
        return committed is not None
