"""Evidence of a hang: the stacks of the stuck ranks, captured when the monitor blames
a hang (``failover.hang_timeout_s``) and before the recovery kills them.

For each suspect, a Ray task on its node (:func:`dlrover_core.runtime.stack_dump.
dump_stacks`: py-spy, else faulthandler on a signal) returns the stacks; the master
writes them to ``<job dir>/stacks/hang-<n>-<role>-<rank>.txt`` and emits
``hang_stacks`` with the files. ``node_health.stack_dump: off`` turns it off.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dlrover_core.runtime.stack_dump import dump_stacks

if TYPE_CHECKING:
    from dlrover_core.master.instances import Instance
    from dlrover_core.master.scope import JobScope

#: s one capture may take (py-spy, or the faulthandler file to grow)
CAPTURE_S = 10.0


def capture_hang_stacks(scope: JobScope, blamed: Instance,
                        suspects: list[Instance]) -> dict[str, str]:
    """Capture the stacks of ``suspects`` (``blamed`` first); returns label -> file
    written (suspects whose capture failed are left out, their error is in the
    ``hang_stacks`` event). Never raises."""
    method = str(scope.spec.node_health.stack_dump)
    if method == "off":
        return {}
    insts = [blamed] + [i for i in suspects if i is not blamed]
    insts = [i for i in insts if i.pid and i.node_id]
    task = ray.remote(num_cpus=0, max_retries=0)(dump_stacks)
    refs = {}
    for inst in insts:
        try:
            refs[task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                inst.node_id, soft=False)).remote(inst.pid, method, scope.job_dir,
                                                   CAPTURE_S)] = inst
        except Exception:  # noqa: BLE001 - evidence only; the recovery goes on
            continue
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=CAPTURE_S + 10)
    n = int(time.time() * 1000)
    files, errors, used = {}, {}, set()
    for ref in refs:
        inst = refs[ref]
        if ref not in ready:
            errors[inst.label] = "the capture did not answer"
            continue
        try:
            out = ray.get(ref)
        except Exception as exc:  # noqa: BLE001
            errors[inst.label] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        used.add(out["method"])
        if not out["text"]:
            errors[inst.label] = out["error"]
            continue
        path = scope.path("stacks", f"hang-{n}-{inst.role}-{inst.rank}.txt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"# {inst.label} pid {inst.pid} node {inst.node_id} step "
                    f"{inst.last_step} ({out['method']})\n{out['text']}")
        files[inst.label] = path
    scope.emit("hang_stacks", role=blamed.role, rank=blamed.rank, blamed=blamed.label,
               files=files, errors=errors, method=sorted(used))
    return files
