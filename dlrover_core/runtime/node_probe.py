"""``NodeProbe``: the actor that measures one bundle (one GPU, or a node's CPUs) for the
pre-flight node check (``dlrover_core.master.node_check``).

It runs in a bundle of the job's placement, with the resources a rank gets there, and
measures, with the same code on a GPU and on a CPU (only the sizes, the dtype and the
clock differ; the sizes come from the job's ``node_health`` section):

- **compute**: ``iters`` batched matmuls (``torch.bmm`` of ``batch`` ``n x n``
  matrices: bfloat16 on the GPU Ray gave it, timed with CUDA events
  (``torch.cuda.Event(enable_timing=True)``, ``elapsed_time`` in ms); float32 on the
  CPU, timed with the host clock, whose BLAS uses the ``OMP_NUM_THREADS`` Ray sets from
  the CPUs it holds), after ``warmup`` untimed ones; ``2 n^3`` floating-point operations
  per matrix, so GFLOP/s = ``2 n^3 batch iters / seconds / 1e9``;
- **network**: ``iters`` all-gathers with one peer (a 2-rank process group, NCCL
  between GPUs, else gloo), after ``warmup`` untimed ones, reported as bus bandwidth in
  GB/s: ``bytes per rank x (world - 1) / seconds per all-gather`` (the all-gather bus
  bandwidth of NCCL's nccl-tests, ``doc/PERFORMANCE.md``; for 2 ranks it is the bytes
  each rank receives per second).

``python -m dlrover_core.runtime.node_probe`` (``make gpu-check``) runs the same
measurements on this machine without Ray: the matmul on every local GPU (or the CPU),
an all-gather between GPUs 0 and 1, 2 and 3, ... (none with one GPU; two processes on
the CPU), with the default sizes of ``node_health``; prints one JSON line.
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable


class NodeProbe:
    """One bundle's probe (created by the master as a Ray actor; see the module doc).

    Args:
        collective: it will take part in all-gathers (kept for the master's call; torch
            is imported now either way, before anything is timed).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; default: ``cuda`` when Ray gave
            this actor a GPU and CUDA is available, else ``cpu``.
    """

    def __init__(self, collective: bool = True, device: str | None = None) -> None:
        import torch

        if device is None:
            import ray

            device = "cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu"
        self.device = device
        if self.on_gpu:
            torch.cuda.set_device(torch.device(device))

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    def info(self) -> dict:
        """``node_id``, ``ip``, ``pid`` and ``device`` (``cpu`` or ``cuda``)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "device": "cuda" if self.on_gpu else "cpu"}

    def matmul(self, size: int, iters: int, batch: int = 1, warmup: int = 1) -> dict:
        """Time ``iters`` batched matmuls of ``batch`` ``size x size`` matrices (bfloat16
        on a GPU, float32 on the CPU) after ``warmup`` untimed ones. Returns
        ``{"seconds", "gflops", "device", "dtype"}`` (GFLOP/s = ``2 size^3 batch iters /
        seconds / 1e9``)."""
        import torch

        dtype = torch.bfloat16 if self.on_gpu else torch.float32
        a = torch.randn(batch, size, size, device=self.device, dtype=dtype)
        b = torch.randn(batch, size, size, device=self.device, dtype=dtype)
        c = torch.empty_like(a)
        for _ in range(warmup):  # allocations, kernel selection, clocks up
            torch.bmm(a, b, out=c)
        seconds = self._timed(lambda: [torch.bmm(a, b, out=c) for _ in range(iters)])
        return {"seconds": seconds, "gflops": 2.0 * size ** 3 * batch * iters / seconds / 1e9,
                "device": self.device, "dtype": str(dtype).replace("torch.", "")}

    def free_port(self) -> int:
        """A free TCP port on this node (the pair's rendezvous)."""
        from dlrover_core.ports import free_port

        return free_port(host="")

    def allgather(self, addr: str, port: int, rank: int, kb: int, iters: int,
                  timeout_s: float, warmup: int = 1, gpu: bool | None = None) -> dict:
        """Join a 2-rank process group at ``addr:port`` as ``rank`` and time ``iters``
        all-gathers of ``kb`` KiB per rank after ``warmup`` untimed ones (the first
        checks the data). ``gpu``: NCCL on this probe's GPU (default: when it has one),
        else gloo on the CPU; both ranks of a pair must agree.

        Returns ``{"seconds", "busbw_gbps"}``: seconds per all-gather and the bus
        bandwidth in GB/s (module doc).

        Raises:
            RuntimeError (or torch's ``DistBackendError``): the peer did not join, a
                collective failed within ``timeout_s``, or the data came back wrong.
        """
        import torch
        import torch.distributed as dist

        gpu = self.on_gpu if gpu is None else gpu
        device = self.device if gpu else "cpu"
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{addr}:{port}",
                                rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            # all_gather_into_tensor's new name (torch 2.13 warns for the old one)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            numel = max(1, kb * 1024 // 4)
            x = torch.full((numel,), float(rank), device=device)
            out = torch.empty(2 * numel, device=device)
            for i in range(max(1, warmup)):
                gather(out, x)
                if i == 0 and float(out[numel]) != 1.0:
                    raise RuntimeError("all-gather returned wrong data")
            per = self._timed(lambda: [gather(out, x) for _ in range(iters)], gpu) / iters
        finally:
            dist.destroy_process_group()
        return {"seconds": per, "busbw_gbps": numel * 4 * (2 - 1) / per / 1e9}

    def _timed(self, work: Callable[[], Any], gpu: bool | None = None) -> float:
        """Seconds ``work`` took: CUDA events on the current stream on a GPU (the
        device's time; the host only queues the kernels), else the host clock."""
        import torch

        if self.on_gpu if gpu is None else gpu:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            work()
            end.record()
            end.synchronize()
            return max(start.elapsed_time(end) / 1000.0, 1e-9)  # ms -> s
        t0 = time.perf_counter()
        work()
        return max(time.perf_counter() - t0, 1e-9)


def remote_node_probe():
    """``NodeProbe`` as a Ray actor class."""
    import ray

    return ray.remote(max_restarts=0)(NodeProbe)


def probe_sizes(options: Any, gpu: bool) -> dict:
    """The sizes of ``node_health`` (a mapping or an object with those attributes) for a
    probe on a GPU or a CPU: ``{"matmul": {size, iters, batch, warmup}, "allgather_kb",
    "allgather_iters", "warmup"}``."""
    get = options.get if isinstance(options, dict) else lambda k: getattr(options, k)
    if gpu:
        return {"matmul": {"size": int(get("gpu_matmul_size")),
                           "iters": int(get("gpu_matmul_iters")),
                           "batch": int(get("gpu_matmul_batch")),
                           "warmup": int(get("gpu_warmup_iters"))},
                "allgather_kb": int(get("gpu_allgather_mb")) * 1024,
                "allgather_iters": int(get("gpu_allgather_iters")),
                "warmup": int(get("gpu_warmup_iters"))}
    return {"matmul": {"size": int(get("matmul_size")), "iters": int(get("matmul_iters")),
                       "batch": int(get("matmul_batch")), "warmup": int(get("warmup_iters"))},
            "allgather_kb": int(get("allgather_kb")),
            "allgather_iters": int(get("allgather_iters")),
            "warmup": int(get("warmup_iters"))}


def _pair_rank(device: str, port: int, rank: int, sizes: dict, timeout_s: float,
               out: Any) -> None:
    """One rank of a local pair's all-gather (a spawned process of :func:`main`)."""
    try:
        res = NodeProbe(device=device).allgather("127.0.0.1", port, rank,
                                                 sizes["allgather_kb"],
                                                 sizes["allgather_iters"], timeout_s,
                                                 sizes["warmup"])
        out.put((rank, True, res))
    except Exception as exc:  # noqa: BLE001 - reported in the JSON line
        out.put((rank, False, f"{type(exc).__name__}: {exc}"[:300]))


def local_check(cpu: bool = False, timeout_s: float = 120.0,
                options: dict | None = None) -> dict:
    """The node check's measurements on this machine, without Ray (module doc):
    ``{"device", "sizes", "devices": [{"device", "gflops", "seconds", "dtype"}],
    "pairs": [{"devices", "ok", "busbw_gbps", "error"}]}``. ``cpu``: the CPU path even
    where GPUs exist; ``options``: ``node_health`` sizes over the defaults."""
    import multiprocessing

    import torch

    from dlrover_core.ports import free_port
    from dlrover_core.spec.node_health import NodeHealthSpec

    opts = vars(NodeHealthSpec())
    sized = sorted(k for k in opts if k.endswith(("_size", "_batch", "_iters", "_kb", "_mb")))
    for key, value in (options or {}).items():
        if key not in sized:
            raise ValueError(f"node_health.{key}: unknown size; allowed: {', '.join(sized)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"node_health.{key}: {value!r} is invalid; allowed: an "
                             "integer >= 1")
    opts = {**opts, **(options or {})}
    gpus = 0 if cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    devices = [f"cuda:{i}" for i in range(gpus)] or ["cpu"]
    sizes = probe_sizes(opts, gpu=gpus > 0)
    out: dict = {"device": "cuda" if gpus else "cpu", "sizes": sizes, "devices": [],
                 "pairs": []}
    for dev in devices:
        res = NodeProbe(device=dev).matmul(**sizes["matmul"])
        out["devices"].append({k: (round(v, 6) if isinstance(v, float) else v)
                               for k, v in res.items()})
    # GPUs 0-1, 2-3, ... (one GPU: no pair); on the CPU two processes
    pairs = [(devices[i], devices[i + 1]) for i in range(0, len(devices) - 1, 2)] \
        if gpus else [("cpu", "cpu")]
    ctx = multiprocessing.get_context("spawn")
    for a, b in pairs:
        q, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_pair_rank, args=(d, port, r, sizes, timeout_s, q))
                 for r, d in enumerate((a, b))]
        for p in procs:
            p.start()
        got = {}
        try:
            for _ in procs:
                rank, ok, res = q.get(timeout=timeout_s + 60)
                got[rank] = (ok, res)
        except Exception as exc:  # noqa: BLE001 - queue.Empty: a rank never answered
            got.setdefault(-1, (False, f"no answer: {type(exc).__name__}"))
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        ok = len(got) == 2 and all(g[0] for g in got.values())
        out["pairs"].append({
            "devices": [a, b], "ok": ok,
            "busbw_gbps": round(min(g[1]["busbw_gbps"] for g in got.values()), 4)
            if ok else None,
            "error": "" if ok else "; ".join(str(g[1]) for g in got.values() if not g[0])})
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m dlrover_core.runtime.node_probe [--cpu] [--timeout-s S]``: prints
    :func:`local_check` as one JSON line; exit status 1 when an all-gather failed."""
    import argparse
    import json

    p = argparse.ArgumentParser(description="the node check's probes on this machine")
    p.add_argument("--cpu", action="store_true", help="the CPU path even where GPUs exist")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a node_health size, e.g. --set matmul_size=128")
    args = p.parse_args(argv)
    options: dict = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            options[key] = int(value)
        except ValueError:
            p.error(f"--set {item!r}: allowed: KEY=INTEGER")
    try:
        res = local_check(cpu=args.cpu, timeout_s=args.timeout_s, options=options)
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(res))
    return 0 if all(pair["ok"] for pair in res["pairs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
