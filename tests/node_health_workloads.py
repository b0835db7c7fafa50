"""Workloads of the node-health tests and of ``benchmarks/straggler.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from dlrover_core import BaseWorkload


class SyncSteps(BaseWorkload):
    """A synchronous SPMD loop: each step does ``config.work`` float32 matmuls of
    ``config.size`` (the rank's own compute, timed as ``compute_s``), then an
    ``all_reduce`` that waits for the slowest rank; reports ``compute_s``, ``step_s``
    (compute + wait) and ``samples`` (``config.batch`` per rank). Runs ``config.steps``
    steps, or ``config.steps_after_restart`` once restarted (attempt >= 1). With
    ``config.checkpoint`` true it saves its next step through the job's checkpointer
    (``checkpoint.every_steps``) and a restart resumes from the newest one, up to
    ``config.steps``."""

    def run(self):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        n, work = int(self.config.get("size", 128)), int(self.config.get("work", 20))
        batch = float(self.config.get("batch", 1))
        steps, start = int(self.config.steps), 0
        ckpt = bool(self.config.get("checkpoint", False))
        extra = {"step": 0}
        if ckpt and self.checkpointer.load(extra=extra) is not None:
            start = int(extra["step"])
        elif self.attempt >= 1:
            steps = int(self.config.get("steps_after_restart", steps))
        a = torch.randn(n, n) / n ** 0.5
        grad = torch.ones(4096)
        for step in range(start, steps):
            t0 = time.perf_counter()
            x = a
            for _ in range(work):
                x = torch.tanh(x @ a)
            t1 = time.perf_counter()
            grad.fill_(float(x[0, 0]))
            dist.all_reduce(grad)
            t2 = time.perf_counter()
            self.report(step, compute_s=t1 - t0, step_s=t2 - t0,
                        samples=batch * self.world_size)
            if ckpt:
                extra["step"] = step + 1
                self.checkpointer.maybe_save(step + 1, extra=extra)
        return steps


def probe_pids(title: str = "ray::NodeProbe", ppid: int | None = None) -> list[int]:
    """Pids of processes whose title (``/proc/PID/cmdline``) starts with ``title``
    (Ray names an actor's process ``ray::<Class>[.<method>]``), children of ``ppid``
    when given."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if not cmd.startswith(title):
                continue
            if ppid is not None and parent_pid(int(entry)) != ppid:
                continue
        except OSError:
            continue
        out.append(int(entry))
    return out


def parent_pid(pid: int) -> int:
    """The parent of ``pid`` (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


class DutyCycle(threading.Thread):
    """Slows processes from outside, as a slow node or a noisy neighbour would: in
    every ``period_s`` they run ``speed * period_s`` and are stopped (``SIGSTOP``) for
    the rest, then continued (``SIGCONT``). ``pids()`` is asked each period (processes
    may come and go). :meth:`stop` continues every process it stopped."""

    def __init__(self, pids: Callable[[], list[int]], speed: float,
                 period_s: float = 0.1) -> None:
        super().__init__(daemon=True, name="duty-cycle")
        if not 0.0 < speed < 1.0:
            raise ValueError(f"speed={speed!r} is invalid; allowed: 0 < speed < 1")
        self.pids, self.speed, self.period_s = pids, speed, period_s
        self.seen: set[int] = set()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            current = self.pids()
            self.seen.update(current)
            _signal(current, signal.SIGSTOP)
            self._halt.wait(self.period_s * (1 - self.speed))
            _signal(current, signal.SIGCONT)
            self._halt.wait(self.period_s * self.speed)
        _signal(list(self.seen), signal.SIGCONT)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        _signal(list(self.seen), signal.SIGCONT)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:  # gone
            pass


class DDPSteps(BaseWorkload):
    """A plain DDP training loop that times nothing itself: an MLP
    (``Linear(config.dim, config.hidden)``, ``Tanh``, ``Linear(config.hidden,
    config.dim)``) wrapped by the role's backend (``ddp``: its gradient all-reduce is
    timed by the backend's hook), one fixed batch of ``config.batch`` rows, SGD; each
    step reports only ``samples`` (``config.batch`` per rank) and ``loss``. The phases
    the master sees come from the reporting layer. Runs ``config.steps`` steps, or
    ``config.steps_after_restart`` once restarted (attempt >= 1)."""

    def run(self):
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(self.rank)
        dim, hidden = int(self.config.get("dim", 256)), int(self.config.get("hidden", 1024))
        steps = int(self.config.steps)
        if self.attempt >= 1:
            steps = int(self.config.get("steps_after_restart", steps))
        model = self.backend.wrap(torch.nn.Sequential(
            torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, dim)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(int(self.config.get("batch", 2048)), dim)
        for step in range(steps):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            self.report(step, samples=float(len(x) * self.world_size), loss=float(loss))
        return steps
