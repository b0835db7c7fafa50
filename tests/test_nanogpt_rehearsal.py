"""The nanogpt workload's ``rehearse()`` (what a standby runs before it is needed) fills
what torch computes on first use for the job's shapes: after it, the real ``setup()``
(model, optimizer, the checkpoint load's template) and the first training step of the
rank the standby becomes find every DTensor sharding propagation cached (counted from
torch's own debug log of cache misses). Without the rehearsal they miss.

Real FSDP2 on a *fake* process group in both parts, one process: the rehearsal always
runs on one (``BaseWorkload.rehearse``), and for the promoted rank it stands in for the
real gloo group of the same world size (DTensor's caches key on the mesh's ranks and
shapes, not on the group's transport). The caches are per thread, so each case runs in
a fresh thread; the rehearsed case runs first, so the unrehearsed one cannot owe its
misses to an empty process-wide cache.
"""

from __future__ import annotations

import logging
import threading

import pytest
from omegaconf import OmegaConf

from dlrover_core.plugins.manager import get_plugin_manager
from dlrover_core.plugins.records import resolve
from dlrover_core.runtime.context import WorkerContext
from dlrover_core.runtime.workload import create_workload, rehearse_standby
from examples.nanogpt.workload import GPTWorkload

#: torch's loggers of sharding-propagation cache misses (the C++ fast path and Python)
MISS_LOGGERS = ("torch.distributed.tensor._dispatch", "torch.distributed.tensor._sharding_prop")


class _Misses(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_thread: dict[int, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if "MISS" in record.getMessage():
            key = threading.get_ident()
            self.by_thread[key] = self.by_thread.get(key, 0) + 1


@pytest.fixture
def misses():
    handler = _Misses()
    saved = []
    for name in MISS_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.level, lg.propagate))
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)  # also resets the C++ fast path's cached flag
        lg.propagate = False
    yield handler
    for lg, level, propagate in saved:
        lg.removeHandler(handler)
        lg.setLevel(level)
        lg.propagate = propagate


def test_the_rehearsal_leaves_the_promoted_rank_nothing_to_propagate(misses, tmp_path):
    config = OmegaConf.to_container(OmegaConf.load("examples/nanogpt/job.yaml").config)
    config.update(n_layer=2)
    pm = get_plugin_manager()

    def context(rank: int) -> WorkerContext:
        return WorkerContext(job="rehearsal", role="trainer", rank=rank, world_size=2,
                             local_rank=rank, local_world_size=2, backend="fsdp",
                             config=config, job_dir=str(tmp_path))

    def session(ctx: WorkerContext):
        return resolve(pm.backends.get("fsdp").session)(ctx)

    session(context(0)).warm_up()  # as every standby's prepare() does first
    counts: dict[str, tuple[int, int]] = {}

    def promoted_rank(case: str) -> None:
        me = threading.get_ident()
        if case == "rehearsed":
            assert rehearse_standby(GPTWorkload, context(0), pm, session(context(0)))
            assert misses.by_thread.get(me, 0) > 0  # the rehearsal propagated them
        before = misses.by_thread.get(me, 0)
        ctx = context(1)
        w = create_workload(GPTWorkload, ctx)
        w._plugins, w._backend = pm, session(ctx)
        with w._backend.fake_group():
            w.setup()  # no checkpoint here: the load makes its template and finds none
            at_setup = misses.by_thread.get(me, 0)
            w.step_on(*w.data.batch("train", int(config["batch_size"]), 128, 1337, 1, 0))
        counts[case] = (at_setup - before, misses.by_thread.get(me, 0) - at_setup)

    for case in ("rehearsed", "cold"):
        t = threading.Thread(target=promoted_rank, args=(case,))
        t.start()
        t.join()
    assert counts["rehearsed"] == (0, 0)
    assert counts["cold"][0] > 0  # without it: the setup propagates shardings afresh
