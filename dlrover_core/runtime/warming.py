"""What a worker process does once to warm up (:mod:`dlrover_core.runtime.host`):
freeze the heap the imports made, and run a backend's warm-up in a thread of its own."""

from __future__ import annotations

import gc
from typing import Any


def freeze_heap(collect: bool = False) -> int:
    """Move every object Python's cyclic garbage collector tracks now into its
    permanent generation (``gc.freeze``), so that no later collection scans them.

    Called once per worker process, when it has imported the workload, torch and Ray
    and before the workload's ``setup()`` makes anything: in a worker of the nanogpt
    job those imports leave 225,000-360,000 tracked objects, and every full (oldest
    generation) collection scanned all of them, 0.10-0.23 s each on 2 cores (timed
    with ``gc.callbacks``): one or two in each rank's ``setup()``, on a recovery's
    path, and about one every 8 s of training, stalling the step of that rank and,
    at the next collective, of every rank. Objects made later (the model, the
    optimizer, what a re-setup in place drops) are collected as before. (CPython's
    documentation of ``gc.freeze`` describes it for long-lived objects of a parent
    process before ``fork``; the saving of scan time is the same.)

    Args:
        collect: run a full collection first (a standby, off the recovery's path), so
            that garbage the imports left is freed instead of kept.
    Returns:
        the number of objects in the permanent generation afterwards.
    """
    if collect:
        gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def in_own_thread(fn: Any) -> Any:
    """Run ``fn()`` in a new thread, wait for it and return its result (or raise what it
    raised).

    A backend's warm-up in a standby runs this way. torch caches DTensor sharding
    propagation per thread, keyed by the operator, the shapes and the DeviceMesh, and a
    DeviceMesh equals another of the same ranks whatever its process group and local
    rank (torch 2.13); a cached result carries the mesh it was computed on. Run in the
    thread that later runs the workload, a warm-up on a fake group (as rank 0) gave a
    promoted spare of rank 1, for every parameter of a shape the warm-up had used, the
    warm-up's mesh, whose coordinate is rank 0's: after one optimizer step, parameter
    and optimizer state said they held rank 0's shard (a 2-process gloo probe of the
    warm-up's own model; a trial warm-up of the job's model on the same path made a
    promoted rank's checkpoint load fail on the shard sizes). In a thread of its own the
    warm-up's cache entries are never looked up again; what it pays for once per
    process (imports, lazy initialisation) stays paid.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlrover-warm-up") as pool:
        return pool.submit(fn).result()
