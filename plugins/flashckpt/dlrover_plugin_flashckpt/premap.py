"""A warm standby's mappings of this node's slots, made before it is promoted.

A process that saved through a buffer holds a mapping whose page tables are filled,
so its load is a copy from the mapping (a memcpy, :mod:`.loading`); a new process
has none, and filling one costs about as much as the copy, so it reads with
``pread`` instead. A warm standby (``failover.standby: true``) does not know which
rank it will replace, so while it waits, :class:`Premapper` keeps every slot of the
role on this node mapped with its page tables filled (``MAP_POPULATE``): it scans
``shm_dir`` every :data:`SCAN_S` seconds, maps a slot that appeared or was replaced
(a larger save lays out a new file) and unmaps one that is gone. Once promoted, the
rank's :class:`.saver.FlashSaver` keeps the mappings of its own slots (:func:`settle`)
and its pool takes them (:func:`take`), so its first load copies from them. A survivor
set up again in place (after a peer failed) hands its saver's mappings to its next saver
the same way (:func:`hand_over`).

Costs, in the standby only: the page tables (8 bytes per 4 KiB page: 2 MiB per GiB of
slots mapped) and one scan per :data:`SCAN_S`; a slot file the ranks replace stays
allocated in ``shm_dir`` until the next scan unmaps it. No copy of the data is made.
"""

from __future__ import annotations

import logging
import os
import re
import threading

from dlrover_plugin_flashckpt import shm

log = logging.getLogger(__name__)

#: seconds between two scans of ``shm_dir``
SCAN_S = 1.0
#: what follows the prefix in a slot's name (:func:`.shm.slot_name`; not a replica's)
_SLOT_TAIL = re.compile(r"^\d{5}-s\d+$")

_lock = threading.Lock()
_current: Premapper | None = None
#: mappings a closed saver of this process handed over (:func:`hand_over`)
_held: dict[str, shm.Segment] = {}


class Premapper:
    """Keeps the slots whose names start with ``prefix`` in ``shm_dir`` mapped (see
    the module docstring), in a daemon thread ``flash-premap``."""

    def __init__(self, shm_dir: str, prefix: str, scan_s: float = SCAN_S) -> None:
        self.shm_dir, self.prefix, self.scan_s = shm_dir, prefix, scan_s
        #: path -> its mapping (page tables filled)
        self.mapped: dict[str, shm.Segment] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="flash-premap", daemon=True)

    def scan(self) -> None:
        """Map the slots that appeared or were replaced, unmap the ones that are gone."""
        paths = [p for p in shm.list_segments(self.shm_dir, self.prefix)
                 if _SLOT_TAIL.match(os.path.basename(p)[len(self.prefix):])]
        for path in paths:
            with self._lock:
                seg = self.mapped.get(path)
                if seg is not None and not seg.replaced():
                    continue
            try:
                new = shm.Segment.attach(path, populate=True)
            except shm.ShmTrustError as exc:
                log.warning("not premapping %s: %s", path, exc)
                continue
            with self._lock:
                old = self.mapped.pop(path, None)
                if new is not None:
                    self.mapped[path] = new
            if old is not None:
                old.close()
        with self._lock:
            gone = [p for p, seg in self.mapped.items() if seg.replaced()]
            segs = [self.mapped.pop(p) for p in gone]
        for seg in segs:
            seg.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.scan()
            except Exception as exc:  # noqa: BLE001 - a premap only saves time
                log.warning("premapping the flash slots: %s: %s", type(exc).__name__, exc)
            self._stop.wait(self.scan_s)

    def stop(self, keep: list[str] | tuple[str, ...] = ()) -> None:
        """Stop scanning; unmap every slot but those at ``keep``."""
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()
        with self._lock:
            drop = [p for p in self.mapped if p not in keep]
            segs = [self.mapped.pop(p) for p in drop]
        for seg in segs:
            seg.close()

    def take(self, path: str) -> shm.Segment | None:
        """The mapping of ``path``, handed over (no longer this object's), or ``None``
        when there is none or its file was replaced since."""
        with self._lock:
            seg = self.mapped.pop(path, None)
        if seg is not None and seg.replaced():
            seg.close()
            return None
        return seg


def start(shm_dir: str, job: str, directory: str, scan_s: float = SCAN_S) -> Premapper:
    """Start keeping the slots of the checkpoint directory ``directory`` of ``job`` in
    ``shm_dir`` mapped in this process (every rank's: a standby does not know its
    rank yet). One per process: a second call replaces the first."""
    global _current
    p = Premapper(shm_dir, f"{shm.job_prefix(job)}{shm.dir_key(directory)}-r", scan_s)
    with _lock:
        old, _current = _current, p
    if old is not None:
        old.stop()
    p.scan()   # what exists now, before the call returns
    p.thread.start()
    return p


def settle(paths: list[str]) -> None:
    """This process became a rank whose slots are at ``paths``: stop scanning and
    unmap every other slot, premapped or handed over (nothing when there is none)."""
    with _lock:
        p = _current
        drop = [_held.pop(k) for k in list(_held) if k not in paths]
    if p is not None:
        p.stop(keep=paths)
    for seg in drop:
        seg.close()


def hand_over(segs: list[shm.Segment]) -> None:
    """Keep the mappings ``segs`` (page tables filled) of a saver this process closes for
    its next saver here: a survivor set up again in place after a peer failed
    (:meth:`.saver.FlashSaver.close_for_resetup`), whose new saver's pool takes them
    (:func:`take`) so that its load copies from memory. A mapping of the same path held
    before is unmapped."""
    old = []
    with _lock:
        for seg in segs:
            prev = _held.get(seg.path)
            if prev is not None and prev is not seg:
                old.append(prev)
            _held[seg.path] = seg
    for seg in old:
        seg.close()


def holds(paths: list[str]) -> bool:
    """Whether this process holds a mapping of any of ``paths``, handed over
    (:func:`hand_over`) or premapped, that a pool of those slots will take (:func:`take`)."""
    with _lock:
        p = _current
        if any(k in _held for k in paths):
            return True
    if p is None:
        return False
    with p._lock:
        return any(k in p.mapped for k in paths)


def take(path: str) -> shm.Segment | None:
    """The mapping of ``path`` handed over (:func:`hand_over`) or premapped (see
    :meth:`Premapper.take`), or ``None``; one whose file was replaced since is unmapped
    and not returned."""
    with _lock:
        p = _current
        seg = _held.pop(path, None)
    if seg is not None:
        if not seg.replaced():
            return seg
        seg.close()
    return p.take(path) if p is not None else None
