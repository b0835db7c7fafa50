"""``NodeProbe``: the actor that measures one node for the pre-flight node check
(``dlrover_core.master.node_check``).

It runs in a bundle of the job's placement on that node, with the resources a rank
gets there, and measures

- **compute**: ``iters`` float32 ``n x n`` matmuls (with torch on the GPU Ray gave it,
  else with numpy on the CPU, whose BLAS uses the ``OMP_NUM_THREADS`` Ray sets from the
  CPUs it holds; numpy so that a CPU-only check does not wait for ``import torch``);
  ``2 n^3`` floating-point operations each, so GFLOP/s = ``2 n^3 iters / seconds / 1e9``;
- **network**: ``iters`` all-gathers with one peer (a 2-rank process group, gloo on
  CPU, NCCL on GPU), reported as bus bandwidth in GB/s: ``bytes per rank x (world - 1)
  / seconds per all-gather`` (the all-gather bus bandwidth of NCCL's nccl-tests,
  ``doc/PERFORMANCE.md``; for 2 ranks it is the bytes each rank receives per second).
"""

from __future__ import annotations

import datetime
import os
import time

import ray

from dlrover_core.ports import free_port


class NodeProbe:
    """One node's probe (created by the master as a Ray actor; see the module doc)."""

    def __init__(self, collective: bool = True) -> None:
        """``collective``: it will take part in all-gathers, so ``torch`` is imported
        now, before anything is timed (a lone node's CPU check needs only numpy)."""
        self.device = "cpu"
        if collective:
            import torch  # noqa: F401
        if ray.get_gpu_ids():
            import torch

            if torch.cuda.is_available():
                self.device = "cuda"

    def info(self) -> dict:
        """``node_id``, ``ip``, ``pid`` and ``device`` (``cpu`` or ``cuda``)."""
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "device": self.device}

    def matmul(self, size: int, iters: int) -> dict:
        """Time ``iters`` ``size x size`` float32 matmuls (after one untimed warm-up).
        Returns ``{"seconds", "gflops"}`` (GFLOP/s = ``2 size^3 iters / seconds / 1e9``)."""
        if self.device == "cuda":
            import torch

            a = torch.randn(size, size, device=self.device)
            b = torch.randn(size, size, device=self.device)
        else:
            import numpy as np

            rng = np.random.default_rng(0)
            a = rng.standard_normal((size, size), dtype=np.float32)
            b = rng.standard_normal((size, size), dtype=np.float32)
        c = a @ b  # warm-up: allocations, kernels
        self._sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            c = a @ b
        self._sync()
        dt = time.perf_counter() - t0
        del c
        return {"seconds": dt, "gflops": 2.0 * size ** 3 * iters / dt / 1e9}

    def free_port(self) -> int:
        """A free TCP port on this node (the pair's rendezvous)."""
        return free_port(host="")

    def allgather(self, addr: str, port: int, rank: int, kb: int, iters: int,
                  timeout_s: float) -> dict:
        """Join a 2-rank process group at ``addr:port`` as ``rank`` and time ``iters``
        all-gathers of ``kb`` KiB per rank (after one untimed warm-up).

        Returns ``{"seconds", "busbw_gbps"}``: seconds per all-gather and the bus
        bandwidth in GB/s (module doc).

        Raises:
            RuntimeError (or torch's ``DistBackendError``): the peer did not join or
                a collective failed within ``timeout_s``.
        """
        import torch
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            numel = max(1, kb * 1024 // 4)
            x = torch.full((numel,), float(rank), device=self.device)
            out = torch.empty(2 * numel, device=self.device)
            dist.all_gather_into_tensor(out, x)
            self._sync()
            if float(out[numel]) != 1.0:
                raise RuntimeError("all-gather returned wrong data")
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_gather_into_tensor(out, x)
            self._sync()
            per = (time.perf_counter() - t0) / iters
        finally:
            dist.destroy_process_group()
        return {"seconds": per, "busbw_gbps": numel * 4 * (2 - 1) / per / 1e9}

    def _sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()


def remote_node_probe():
    """``NodeProbe`` as a Ray actor class."""
    return ray.remote(max_restarts=0)(NodeProbe)
