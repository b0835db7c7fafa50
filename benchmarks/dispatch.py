"""Role-group dispatch against raw Ray calls to the same actors.

    .venv/bin/python benchmarks/dispatch.py [--repeats 200] [--workers 4] [--mib 4]

Three operations, each timed three (or four) ways on the same local Ray cluster, in
one run, the variants interleaved in a shuffled order on every repetition:

1. **broadcast**: a no-op on every worker and wait for all.
   ``rolegroup``: ``RoleGroup.noop()``; ``raw_host``: ``ray.get([h.call.remote("noop")])``
   on the same ``WorkloadHost`` actors; ``plain_actor``: ``ray.get([a.noop.remote()])``
   on plain ``@ray.remote`` actors with the method.
2. **scatter**: a ``--mib`` MiB float32 array split in contiguous row blocks, one per
   worker (auto-shard for the role group, slices by hand for the others).
3. **DRef hand-off**: a producer role (``--workers`` ranks, ``--mib`` MiB in all) hands
   its results to a consumer role (same ranks), rank ``i`` to rank ``i``.
   ``dref``: ``consumer.consume(producer.produce.options(blocking=False)())``;
   ``raw_ref``: the producer's ``ObjectRef`` s passed as top-level arguments of raw
   ``call.remote`` (Ray resolves them before the call); ``via_driver``: the results are
   fetched into this process and sent again.

Every figure is the median in milliseconds over ``--repeats`` repetitions (half as
many for the scatter and the hand-off, at least 50). The machine's other load moves
the figures by a few per cent from run to run; compare ratios within one run. The last
line of output is one JSON object with the medians and the ratios
``broadcast_ratio`` / ``scatter_ratio`` (role group / raw call on the same hosts),
``dref_handoff_ratio`` (DRef / raw ObjectRef hand-off), ``dref_vs_driver_ratio``
(DRef / through the driver), and ``*_vs_plain`` against plain actors.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from dlrover_core import BaseWorkload


class BenchWorkload(BaseWorkload):
    """The workload under test: trivial methods, so only dispatch is measured."""

    def noop(self) -> None:
        return None

    def take(self, block: np.ndarray) -> int:
        """Rows received."""
        return int(block.shape[0])

    def produce(self, nbytes: int) -> np.ndarray:
        return np.full(nbytes // 4, self.rank, dtype=np.float32)

    def consume(self, data: Any) -> int:
        """Bytes received (a DRef shard arrives as the producer's array)."""
        return int(data.nbytes)


class PlainActor:
    """The same methods on a plain Ray actor (no dlrover host in between)."""

    def noop(self) -> None:
        return None

    def take(self, block: np.ndarray) -> int:
        return int(block.shape[0])


def spawn(role: str, n: int) -> list:
    """``n`` real ``WorkloadHost`` actors running :class:`BenchWorkload`, set up."""
    import ray

    from dlrover_core.runtime.context import WorkerContext
    from dlrover_core.runtime.host import remote_workload_host

    cls = remote_workload_host()
    handles = [cls.options(num_cpus=0).remote("benchmarks.dispatch:BenchWorkload", WorkerContext(
        job="bench", role=role, rank=r, world_size=n, local_rank=r, local_world_size=n))
        for r in range(n)]
    ray.get([h.setup.remote("", 0) for h in handles])
    return handles


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_interleaved(variants: dict[str, Callable[[], Any]], repeats: int, warmup: int,
                    rng: random.Random) -> dict[str, float]:
    """Median ms of each variant; every repetition runs all variants in a random order."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for _ in range(repeats):
        rng.shuffle(names)
        for k in names:
            samples[k].append(timed(variants[k]))
    return {k: round(statistics.median(v), 4) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="role-group dispatch vs raw Ray calls")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--mib", type=float, default=4.0, help="scatter / hand-off size in MiB")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import ray

    from dlrover_core.master.client import init_ray
    from dlrover_core.runtime import RoleGroup

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.chdir(root)  # workers import benchmarks.dispatch from the repository root
    if root not in sys.path:
        sys.path.insert(0, root)
    temp_dir = tempfile.mkdtemp(prefix="dlrbench", dir="/tmp")
    init_ray(None, num_cpus=max(4, args.workers), _temp_dir=temp_dir)
    rng = random.Random(args.seed)
    n = args.workers
    try:
        hosts = spawn("bench", n)
        sinks = spawn("sink", n)
        plain = [ray.remote(num_cpus=0)(PlainActor).remote() for _ in range(n)]
        ray.get([a.noop.remote() for a in plain])
        group, sink_group = RoleGroup("bench", hosts), RoleGroup("sink", sinks)

        nbytes = int(args.mib * 1024 * 1024)
        rows = nbytes // (4 * 256)
        batch = np.ones((rows, 256), dtype=np.float32)  # args.mib MiB
        bounds = np.linspace(0, rows, n + 1).astype(int)
        per_rank = nbytes // n

        def raw_scatter(handles, via_call: bool) -> list:
            parts = [batch[bounds[i]:bounds[i + 1]] for i in range(n)]
            if via_call:
                return ray.get([h.call.remote("take", parts[i]) for i, h in enumerate(handles)])
            return ray.get([h.take.remote(parts[i]) for i, h in enumerate(handles)])

        assert sum(group.take(batch)) == rows  # auto-shard covers every row once
        broadcast = run_interleaved({
            "rolegroup": lambda: group.noop(),
            "raw_host": lambda: ray.get([h.call.remote("noop") for h in hosts]),
            "plain_actor": lambda: ray.get([a.noop.remote() for a in plain]),
        }, args.repeats, 20, rng)
        scatter = run_interleaved({
            "rolegroup": lambda: group.take(batch),
            "raw_host": lambda: raw_scatter(hosts, True),
            "plain_actor": lambda: raw_scatter(plain, False),
        }, max(50, args.repeats // 2), 5, rng)

        def dref_handoff() -> list:
            ref = group.produce.options(blocking=False, auto_shard=False)(per_rank)
            return sink_group.consume(ref)

        def raw_handoff() -> list:
            refs = [h.call.remote("produce", per_rank) for h in hosts]
            return ray.get([s.call.remote("consume", r) for s, r in zip(sinks, refs)])

        def via_driver() -> list:
            values = ray.get([h.call.remote("produce", per_rank) for h in hosts])
            return ray.get([s.call.remote("consume", v) for s, v in zip(sinks, values)])

        assert dref_handoff() == raw_handoff() == via_driver() == [per_rank // 4 * 4] * n
        handoff = run_interleaved({"dref": dref_handoff, "raw_ref": raw_handoff,
                                   "via_driver": via_driver},
                                  max(50, args.repeats // 2), 5, rng)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)

    def ratio(a: float, b: float) -> float:
        return round(a / b, 3)

    result = {
        "workers": n, "mib": args.mib, "repeats": args.repeats,
        "broadcast_ms": broadcast, "scatter_ms": scatter, "dref_handoff_ms": handoff,
        "broadcast_ratio": ratio(broadcast["rolegroup"], broadcast["raw_host"]),
        "scatter_ratio": ratio(scatter["rolegroup"], scatter["raw_host"]),
        "dref_handoff_ratio": ratio(handoff["dref"], handoff["raw_ref"]),
        "dref_vs_driver_ratio": ratio(handoff["dref"], handoff["via_driver"]),
        "broadcast_vs_plain": ratio(broadcast["rolegroup"], broadcast["plain_actor"]),
        "scatter_vs_plain": ratio(scatter["rolegroup"], scatter["plain_actor"]),
    }
    print(f"broadcast no-op to {n} workers (ms): {broadcast}")
    print(f"scatter {args.mib:g} MiB over {n} workers (ms): {scatter}")
    print(f"hand-off {args.mib:g} MiB producer -> consumer (ms): {handoff}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
