"""The work loop of the per-node persister (a mixin of
:class:`.persister.FlashPersister`): pick the next step to persist, claim its slots,
write every local rank's files, release the slots and commit. Imports no torch.

Order: per role, the steps that every local rank holds in a READY slot, not yet
persisted, and due (``persist_every_steps``) or forced (breakpoint, ``wait()``, job
end); forced steps first, then steps another node already started, then the newest.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass, field

from dlrover_plugin_flashckpt import shm, storage

log = logging.getLogger("dlrover_plugin_flashckpt.persister")

POLL_S = 0.5


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
    replica_transport: str = "tcp"
    extra: dict = field(default_factory=dict)


@dataclass
class _Claim:
    rank: int
    seg: shm.Segment
    seq: int


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
                if h.step != step or not (shm.holds_step(h) or mine) \
                        or (h.rank, h.world_size) != (r.rank, r.world_size):
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
            with self._lock:  # a flush waits for the rename, ``latest`` and the prune
                self._committing.add(first.dir)
            try:
                committed = storage.try_commit(first.dir, step, first.world_size, first.keep,
                                               attempt=attempts[0])
            except Exception as exc:  # noqa: BLE001
                self._error(f"committing {role} step {step} failed: {type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._committing.discard(first.dir)
        with self._lock:
            if committed:
                self._forced.get(role, set()).discard(step)
            self.history.append({"role": role, "step": step, "ranks": sorted(results),
                                 "committed": committed,
                                 "seconds": round(time.monotonic() - t0, 4)})
            del self.history[:-50]
        return True
