"""The ``disk`` saver's case: ranks in one gloo process group (the saver's collectives
need one when there are several ranks), each with a :class:`DiskSaver` of the run's
folder; a save returns once its step is committed."""

from __future__ import annotations

import os
from typing import Any

NAME = "disk"
#: crash points of this saver: their names start with this
PREFIX = "disk."
#: after which operation a saved step must be committed: ``save`` (it is synchronous)
DURABLE_AFTER = "save"
#: modules that declare this saver's crash points
MODULES = ["dlrover_core.checkpoint.disk", "dlrover_core.checkpoint.saver"]


def setup_rank(spec: dict) -> None:
    """A gloo group of ``spec["world"]`` ranks (none for one rank), 20 s timeout."""
    if spec["world"] > 1:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="file://" + os.path.join(
            spec["run_dir"], f"pg-{spec['phase']}"), rank=spec["rank"],
            world_size=spec["world"], timeout=timedelta(seconds=20))


def teardown_rank(spec: dict) -> None:
    """Nothing: the process ends (a broken group is not torn down)."""


def make_saver(spec: dict) -> Any:
    from dlrover_core.checkpoint.disk import DiskSaver
    from dlrover_core.checkpoint.saver import SaverConfig, SaverContext

    from crashtest.plan import KEEP

    return DiskSaver(SaverConfig(dir=spec["ckpt"], keep=KEEP, job=spec["job"]),
                     SaverContext(rank=spec["rank"], world_size=spec["world"],
                                  distributed=spec["world"] > 1))


def save(saver: Any, spec: dict, step: int, state: dict) -> None:
    """Save ``state`` under the key ``rank<k>``: DCP keeps one copy of a plain tensor
    that every rank holds under the same key (replicated), so distinct keys keep each
    rank's own state."""
    saver.save(step, {f"rank{spec['rank']}": state})


def load(saver: Any, spec: dict, state: dict, step: int | None) -> int | None:
    """Load into ``state`` (see :func:`save`)."""
    return saver.load({f"rank{spec['rank']}": state}, step)


def rank_report(saver: Any) -> dict:
    """Nothing beyond the operations' results."""
    return {}


def committed(ckpt: str) -> list[int]:
    """The committed steps in ``ckpt`` as a new process lists them."""
    from dlrover_core.checkpoint.saver import committed_steps

    return committed_steps(ckpt)


#: the fault-free trace run's variant (flash: the memory wiped, so that the restart
#: reaches the disk load's points)
TRACE_VARIANT: dict = {}


def target(point) -> str | None:
    """``None``: the rank that reaches the point is armed."""
    return None


def variants(point, fault: str, world: int, quick: bool) -> list[dict]:
    """One run per (point, fault, ranks, hit): ``[{}]``."""
    return [{}]


#: rank counts and faults of the quick subset
QUICK_WORLDS = (1, 2, 4)
QUICK_FAULTS = ("sigkill", "enospc")


def nths(count: int, world: int, quick: bool) -> list[int]:
    """Which hits of a point (``count`` in the fault-free fault phase) are faulted: each
    of the first 5 (a disk run takes a fraction of a second) with 1 and 2 ranks, the
    first and the last with 4; the first when ``quick``."""
    if quick or count < 1:
        return [1] if count >= 1 else []
    if world == 4:
        return sorted({1, count})
    return list(range(1, min(count, 5) + 1))


def begin_run(info: dict) -> dict:
    """Nothing beyond the rank processes; returns ``{}``."""
    return {}


def pids(ctx: dict) -> dict[int, str]:
    """No process besides the ranks."""
    return {}


def end_run(run: dict) -> None:
    """Nothing to stop."""


def before_restart(run: dict) -> dict:
    """Between the phases: with ``run["corrupt"]`` (the harness's self-test) flip a
    byte of the newest committed step's first shard file, so that the restart cannot
    resume it bit for bit. Returns ``{}``."""
    if run.get("corrupt"):
        corrupt_newest(os.path.join(run["run_dir"], "ckpt"))
    return {}


def corrupt_newest(ckpt: str) -> str:
    """Flip one byte in the middle of the newest committed step's largest file (not
    its manifest); returns the file's path.

    Raises:
        FileNotFoundError: no step is committed in ``ckpt``.
    """
    from dlrover_core.checkpoint.saver import step_dir_name

    steps = committed(ckpt)
    if not steps:
        raise FileNotFoundError(f"{ckpt}: no committed step to corrupt")
    d = os.path.join(ckpt, step_dir_name(steps[-1]))
    files = [os.path.join(d, f) for f in os.listdir(d) if f != "manifest.json"]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


def wedged(run: dict) -> list[str]:
    """Leftovers that block the next save: none beyond a failed restart save."""
    return []
