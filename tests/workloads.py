"""Workloads used by the core tests (imported by the Ray workers)."""

from __future__ import annotations

import os
import time

from dlrover_core import BaseTrainer, BaseWorkload, trainer_invocation


def double_all(results):
    return [r * 2 for r in results]


def add_one(x):
    return (x + 1,)


class Echo(BaseWorkload):
    greeting = "hello"  # a class attribute: not callable through a role group

    def setup(self):
        self.calls = []

    @property
    def doubled_rank(self):
        return 2 * self.rank

    def _private(self):
        return "private"

    def noop(self):
        return None

    def whoami(self):
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                "env_rank": os.environ["RANK"], "role": self.role}

    def rank_sum(self):
        """The sum of the ranks over the role's process group (an ``all_reduce``)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(self.rank)])
        dist.all_reduce(t)
        return float(t.item())

    def take(self, items):
        """Returns what this rank received."""
        return list(items)

    def take_kw(self, items=None, scale=1):
        return [i * scale for i in items]

    def produce(self, n):
        return [self.rank * 100 + i for i in range(n)]

    def consume(self, data):
        return {"rank": self.rank, "data": data, "pid": os.getpid()}

    @trainer_invocation(target="RANK0")
    def only_rank0(self):
        return self.rank

    @trainer_invocation(timeout=0.5)
    def slow(self, seconds):
        time.sleep(seconds)
        return seconds

    @trainer_invocation(pre_func=add_one, post_func=double_all, auto_shard=False)
    def incremented(self, x):
        return x

    @trainer_invocation(blocking=False)
    def later(self, x):
        return x * 10

    def record(self, i):
        self.calls.append(i)
        return list(self.calls)

    def fail(self):
        raise ValueError("boom from rank %d" % self.rank)


class PingDriver(BaseTrainer):
    """An MPMD driver used by the job tests: producer results go to the consumer as DRefs."""

    def fit(self):
        refs = self.RG_PRODUCER.produce.options(blocking=False)(self.config.n)
        got = self.RG_CONSUMER.consume.options(auto_shard=True)(refs)
        self.report(0, consumed=float(sum(len(g["data"]) for g in got)))
        assert self.get_role_groups() == ["consumer", "producer"]
        return got


class BrokenSetup(BaseWorkload):
    """A user bug before the first step: a missing import."""

    def setup(self):
        import numpy_does_not_exist  # noqa: F401

    def run(self):
        return None


class StepDriver(BaseTrainer):
    """A driver that counts iterations, saving its state, and calls every role each step."""

    def init(self):
        self.state = self.load_state() or {"it": 0}

    def fit(self):
        import time as _t

        while self.state["it"] < int(self.config.iterations):
            self.RG_PRODUCER.noop.options(auto_shard=False)()
            self.state["it"] += 1
            self.save_state(self.state)
            self.report(self.state["it"] - 1, it=float(self.state["it"]))
            _t.sleep(float(self.config.get("sleep_s", 0.2)))
        return self.state["it"]


class BadNodeError(RuntimeError):
    """What a worker on a broken node raises (the scenario's classifier says ``node``)."""


class NodeSensitive(BaseWorkload):
    """Steps ``config.steps`` times (``config.sleep_s`` each); raises ``BadNodeError`` at
    any step while its node id is listed in ``<job_dir>/bad_nodes`` (one per line)."""

    def run(self):
        import ray

        node = ray.get_runtime_context().get_node_id()
        path = os.path.join(self.job_dir, "bad_nodes")
        for step in range(int(self.config.steps)):
            if os.path.exists(path):
                with open(path) as f:
                    if node in f.read().split():
                        raise BadNodeError(f"uncorrectable ECC error on node {node[:12]}")
            time.sleep(float(self.config.sleep_s))
            self.report(step, node=float(int(node[:6], 16)))
        return node


class StuckCall(BaseWorkload):
    """Driven by ``StuckDriver``: ``work(i)`` returns at once, except on rank 1 at
    ``config.stuck_at`` in attempt 0, where it never returns (a hung role call)."""

    def work(self, i):
        if self.rank == 1 and i == int(self.config.stuck_at) and self.attempt == 0:
            time.sleep(3600)
        return i


class StuckDriver(BaseTrainer):
    """Calls ``RG_WORKER.work(i)`` for ``config.iterations``, saving its state."""

    def init(self):
        self.state = self.load_state() or {"it": 0}

    def fit(self):
        while self.state["it"] < int(self.config.iterations):
            self.RG_WORKER.work.options(auto_shard=False)(self.state["it"])
            self.state["it"] += 1
            self.save_state(self.state)
            self.report(self.state["it"] - 1, it=float(self.state["it"]))
        return self.state["it"]


#: weak references to each ``HeapProbe`` setup's reference cycle, in setup order
HEAP_PROBE_REFS: list = []


class _Cycle:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic garbage collector frees it


class HeapProbe(BaseWorkload):
    """Its ``setup()`` makes a reference cycle (as a model with hooks that refer back to
    it does) and keeps it, with a weak reference in ``HEAP_PROBE_REFS``."""

    def setup(self):
        import weakref

        self.cycle = _Cycle()
        HEAP_PROBE_REFS.append(weakref.ref(self.cycle))

    def heap(self):
        """After a full collection: the permanent generation's size (``gc.freeze``) and,
        per setup so far, whether its cycle is still alive."""
        import gc

        gc.collect()
        return {"frozen": gc.get_freeze_count(),
                "alive": [r() is not None for r in HEAP_PROBE_REFS]}


class PriorityProbe(BaseWorkload):
    """Its ``warm_up()`` (a standby's, in ``prepare()``) writes ``warm.json`` into
    ``$PRIORITY_PROBE_DIR``: its thread's id (``tid``), and the scheduling policy
    (``os.SCHED_*``) of its thread (``before``) and of a thread it starts (``child``);
    then, once ``$PRIORITY_PROBE_DIR/go`` exists (at most 60 s), its thread's policy
    and nice value again (``after``, ``nice``)."""

    @classmethod
    def warm_up(cls):
        import json
        import threading

        where = os.environ["PRIORITY_PROBE_DIR"]
        seen = {"tid": threading.get_native_id(), "before": os.sched_getscheduler(0)}

        def child() -> None:
            seen["child"] = os.sched_getscheduler(0)

        t = threading.Thread(target=child)
        t.start()
        t.join()
        with open(os.path.join(where, "started"), "w"):
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(where, "go")) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.update(after=os.sched_getscheduler(0), nice=os.getpriority(os.PRIO_PROCESS, 0))
        with open(os.path.join(where, "warm.json"), "w") as f:
            json.dump(seen, f)


def shard_coordinates_after_a_step(rank: int, world_size: int) -> list:
    """On a fake process group as ``rank`` of ``world_size`` (made and destroyed here):
    the ``fsdp`` backend's warm-up step (``dlrover_plugin_fsdp.backend.warm_up_step``,
    its shapes); the DeviceMesh coordinates of the first weight's DTensor and of its
    ``exp_avg``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dlrover_plugin_fsdp.backend import warm_up_step

    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        model, opt = warm_up_step(init_device_mesh("cpu", (world_size,)))
        weight = model[0].weight
        return [tuple(weight._spec.mesh.get_coordinate()),
                tuple(opt.state[weight]["exp_avg"]._spec.mesh.get_coordinate())]
    finally:
        dist.destroy_process_group()


class ForwardLoop(BaseWorkload):
    """A small module's forward pass in a loop (``forward_until``), for the forward
    stop of a survivor (``dlrover_core.runtime.attempt_stop``)."""

    def setup(self):
        import torch

        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())

    def forward_until(self, stop: str, started: str) -> int:
        """Forward passes until the file ``stop`` exists (at most 60 s), after creating
        the file ``started``; returns how many ran."""
        import torch

        x, n = torch.ones(2, 8), 0
        with open(started, "w"):
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(stop) and time.monotonic() < deadline:
            self.model(x)
            n += 1
        self.model(x)   # (one at least, also when ``stop`` exists from the start)
        return n + 1

    def global_hooks(self) -> int:
        """How many global forward pre-hooks this process has."""
        from torch.nn.modules import module

        return len(module._global_forward_pre_hooks)
