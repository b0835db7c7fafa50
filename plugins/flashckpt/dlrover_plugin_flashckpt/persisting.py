"""The work loop of the per-node persister (a mixin of :class:`.persister.FlashPersister`):
pick the next step, claim its slots, write the local ranks' files, release, commit.

Order: per role, the steps that every local rank holds in a READY slot, not yet
written, and due (``persist_every_steps``) or forced (breakpoint, ``wait()``, job
end); forced steps first, then steps another node already started, then the newest.
When nothing is to be written, the commit of a step whose files are written but not
committed (another node's ranks came later, or a commit was interrupted: a kill,
``ENOSPC``, a lock lost) is tried again (:meth:`PersistMixin._commit_candidates`).

A save counts as persisted (``persisted_seq``) only once its step (or a newer one of
the lineage) is committed; a save whose files are in the temp directory (a marker, or
a commit's intent: :func:`.storage.written_saves`) is not written again. A failure is
retried after a backoff (:mod:`.failures`); the status says that persisting fails.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback

from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_flashckpt import shm, storage
from dlrover_plugin_flashckpt.failures import PersistFailures

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
declare("flash.persist.committed", "state", "persist",
        "the persister marked a save persisted: its step (or a newer one) is committed")


class PersistMixin:
    """The persist loop and the slot claims of :class:`.persister.FlashPersister` (which
    provides the registrations, the locks and events, and the history)."""

    # provided by FlashPersister
    job: str
    pid: int
    start: int
    _lock: threading.RLock
    _wake: threading.Event
    _stop: threading.Event
    _regs: dict[tuple[str, int], Registration]
    _segs: dict[str, shm.Segment]
    _retired: list[shm.Segment]
    _forced: dict[str, set[int]]
    _committing: set[str]
    current: dict | None
    history: list[dict]
    errors: list[str]
    failures: PersistFailures

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

    def _rank_steps(self, r: Registration, pending_only: bool
                    ) -> dict[int, tuple[shm.Segment, shm.Header]]:
        out: dict[int, tuple[shm.Segment, shm.Header]] = {}
        for path in r.slots:
            seg = self._seg(path)
            if seg is None:
                continue
            h = seg.read_header()
            if not shm.holds_step(h):
                continue
            # a slot's name has no world size: after a resize, this rank's buffers
            # still hold the saves of the old world (another rank's shard of another
            # layout); they are only read by a resharding load, never persisted or
            # replicated as this registration's
            if h.rank != r.rank or h.world_size != r.world_size:
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
        """Headers of the local ranks whose save of ``step`` is neither committed nor
        written into the step's temp directory, or ``None`` when some local rank does
        not hold ``step``."""
        out = []
        written: set | None = None
        for r in regs:
            found = self._rank_steps(r, pending_only=False).get(step)
            if found is None:
                return None
            h = found[1]
            if h.persisted_seq == h.seq:
                continue
            if written is None:
                written = storage.written_saves(r.dir, step)
            if (r.rank, h.seq, h.saved_at) not in written:
                out.append(h)
        return out

    def _needs_persist(self, role: str, step: int) -> bool:
        """Whether ``step`` of ``role`` is not committed yet."""
        regs = [r for (ro, _), r in self._regs.items() if ro == role]
        newest = storage.newest_committed(regs[0].dir) if regs else None
        return newest is None or newest < step

    def _claim(self, role: str, step: int) -> list[Claim]:
        """Mark every local rank's slot holding ``step`` PERSISTING; all or nothing."""
        regs = sorted((r for (ro, _), r in self._regs.items() if ro == role),
                      key=lambda r: r.rank)
        claims: list[Claim] = []
        written = storage.written_saves(regs[0].dir, step) if regs else set()
        for r in regs:
            found = self._rank_steps(r, pending_only=True).get(step)
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
        step is committed (:meth:`_retire_obsolete`)."""
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

    def _retire_obsolete(self, regs: list[Registration], newest: int | None) -> None:
        """Mark saves at or below the newest committed step as persisted: that step
        is on disk, or they will never be written, and a save must not keep them as
        "waiting for the disk"."""
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
                        crashpoint("flash.persist.committed", path=seg.path)

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
            self._wake.wait(self.failures.wait_s(POLL_S))
            self._wake.clear()
            if not self.failures.due():
                continue  # backing off after a failure: a save's wake-up is no retry
            try:
                with self._lock:
                    for seg in self._retired:
                        seg.close()
                    self._retired.clear()
                while not self._stop.is_set() and self.failures.due() \
                        and self._persist_one():
                    pass
            except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                self._failed("the persister loop", exc, traceback.format_exc(limit=5))

    def _error(self, msg: str) -> None:
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
        """Write the next step's local files and try its commit, or else try the
        commit of a step written but not committed. True when it got on (the loop goes
        on at once); False when there was nothing to do or it failed (the loop waits
        :data:`POLL_S`, or the backoff)."""
        with self._lock:
            picked = self._pick()
            self._release_other_claims(picked)
            if picked is None:
                todo = self._commit_candidates()
            else:
                role, step = picked
                claims = self._claim(role, step)
                regs = {r.rank: r for (ro, _), r in self._regs.items() if ro == role}
        if picked is None:
            for c in todo:
                done = self._commit(*c)
                if done is not False:
                    return bool(done)  # landed: go on; failed (None): back off
            self._check_recovered()
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
        committed = None
        if len(results) == len(claims):
            committed = self._commit(role, step, first, attempts[0])
        with self._lock:
            self.history.append({"role": role, "step": step, "ranks": sorted(results),
                                 "committed": bool(committed),
                                 "seconds": round(time.monotonic() - t0, 4)})
            del self.history[:-50]
        return committed is not None

    def _commit(self, role: str, step: int, reg: Registration,
                attempt: dict | None) -> bool | None:
        """Try the commit of ``step`` (``attempt``'s files, or an interrupted commit);
        True when it landed now, False when it cannot yet (ranks missing, another
        committer), ``None`` when it failed (recorded, backing off)."""
        with self._lock:  # a flush waits for the rename, ``latest`` and the prune
            self._committing.add(reg.dir)
        try:
            storage.finish_tail(reg.dir, reg.keep)
            committed = storage.try_commit(reg.dir, step, reg.world_size, reg.keep,
                                           attempt=attempt, markers=attempt is not None)
        except Exception as exc:  # noqa: BLE001
            self._failed(f"committing {role} step {step}", exc, where=(reg.dir, step))
            return None
        finally:
            with self._lock:
                self._committing.discard(reg.dir)
        newest = storage.newest_committed(reg.dir)
        if newest is not None and newest >= step:
            self.failures.succeeded()
            with self._lock:
                self._forced.get(role, set()).discard(step)
                self._retire_obsolete([r for (ro, _), r in self._regs.items() if ro == role],
                                      newest)
        return committed

    def _commit_candidates(self) -> list[tuple[str, int, Registration, dict | None]]:
        """Steps newer than the newest commit whose local files are all written, and
        temp directories holding an interrupted commit's intent; newest first."""
        out = []
        for role in sorted({ro for ro, _ in self._regs}):
            regs = [r for (ro, _), r in self._regs.items() if ro == role]
            newest = storage.newest_committed(regs[0].dir)
            found: dict[int, dict | None] = {}
            for step in sorted(self._common_steps(regs), reverse=True):
                if (newest is None or step > newest) and self._pending(regs, step) == []:
                    seg, h = self._rank_steps(regs[0], pending_only=False)[step]
                    found[step] = save_attempt(seg.meta_bytes(h), regs[0])
            for step in storage.pending_tmp_steps(regs[0].dir):  # an intent: finish it
                if (newest is None or step > newest) and step not in found and \
                        storage.read_intent(storage.tmp_dir(regs[0].dir, step)) is not None:
                    found[step] = None
            if not found and storage.tail_pending(regs[0].dir, newest):
                found[newest] = None  # a crash stopped a commit after its move
            out += [(role, s, regs[0], found[s]) for s in sorted(found, reverse=True)]
        return out

    def _check_recovered(self) -> None:
        """End the failing state when the step that failed is committed now."""
        failing = self.failures.state()
        if failing is None or failing.get("dir") is None:
            return
        newest = storage.newest_committed(failing["dir"])
        if newest is not None and newest >= failing["step"]:
            self.failures.succeeded()
