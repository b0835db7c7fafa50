"""A real FlashPersister without Ray: its own threads over shared-memory slots that a
test fills (in a directory of its own), in this process or in a child process that a
crash point can SIGKILL. Used by the persister fault tests.

As a script (the child persister)::

    python persist_scenario.py SHM_DIR CKPT_DIR JOB STEP WORLD [TIMEOUT]

registers every slot of JOB in SHM_DIR (ranks 0..WORLD-1) with a persister of its own,
asks it to commit STEP and prints the newest committed step; the crash point armed in
its environment (``DLROVER_CRASHPOINT``) may kill it on the way.
"""

from __future__ import annotations

import os
import sys
import time

from dlrover_plugin_flashckpt import shm

ROLE = "trainer"


def make_slot(shm_dir: str, job: str, directory: str, rank: int, world: int, step: int,
              payload: bytes, slot: int = 0, seg: shm.Segment | None = None,
              cap: int = 0) -> shm.Segment:
    """A READY, due save of ``step`` (``payload`` as its data, ``b"meta<rank>"`` as its
    meta block) in slot ``slot`` of ``rank`` (a new buffer of ``cap`` data bytes, at
    least the payload's); ``seg``: save again into that buffer (its ``seq`` grows)."""
    if seg is None:
        path = os.path.join(shm_dir, shm.slot_name(job, directory, rank, slot))
        seg = shm.Segment.create(path, 4096, max(len(payload), cap, 1),
                                 {"job": job, "dir": directory, "role": ROLE, "rank": rank},
                                 b"\0" * 16, rank, world, populate=False)
    meta = b"meta%d" % rank
    h = seg.read_header()
    seg.write_meta(meta)
    seg.mm[h.data_offset:h.data_offset + len(payload)] = payload
    with seg.locked():
        h = seg.read_header()
        h.state, h.step, h.seq, h.due = shm.READY, step, h.seq + 1, 1
        h.meta_len, h.data_len, h.saved_at = len(meta), len(payload), time.time()
        seg.write_header(h)
    return seg


def registration(shm_dir: str, job: str, directory: str, rank: int, world: int,
                 keep: int = 2) -> dict:
    return {"role": ROLE, "rank": rank, "world_size": world, "dir": directory, "keep": keep,
            "slots": [os.path.join(shm_dir, shm.slot_name(job, directory, rank, 0))],
            "shm_dir": shm_dir}


def persister(shm_dir: str, job: str, directory: str, world: int, keep: int = 2):
    """A FlashPersister of this process with every rank of ``job`` registered."""
    from dlrover_plugin_flashckpt.persister import FlashPersister

    p = FlashPersister(job, "", "test-node", shm_dir)
    for r in range(world):
        p.saved(registration(shm_dir, job, directory, r, world, keep))
    return p


def stop(p) -> None:
    """End ``p``'s threads without removing the buffers (a node's persister that dies)."""
    p.loop.thread.end(10)
    p.sender.thread.end(10)


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout:g} s: {what}")


if __name__ == "__main__":
    shm_dir, directory, job, step, world = sys.argv[1:6]
    timeout = float(sys.argv[6]) if len(sys.argv) > 6 else 30.0
    p = persister(shm_dir, job, directory, int(world))
    print(p.flush(ROLE, int(step), timeout=timeout), flush=True)
    stop(p)
