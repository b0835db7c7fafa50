"""PPO weight sync (trainer -> rollout workers) against a raw ``ray.put`` + ``ray.get``
fan-out of the same tensors, in one run on one local Ray cluster.

    .venv/bin/python benchmarks/weight_sync.py [--sizes-mib 64 256] [--workers 1 2]
        [--repetitions 3] [--tensor-mib 16] [--device cpu|cuda]

The actor role (one rank, ``dlrover_plugin_ppo``'s ``ActorWorkload``) holds a float32
model of ``--sizes-mib`` MiB in ``--tensor-mib`` MiB parameters; ``N`` rollout ranks
(``RolloutWorkload``, ``N`` from ``--workers``) hold the same shapes. Every repetition
first fills the actor's parameters with new random values, then moves them once each
way, in a shuffled order:

- ``ours``: the plugin's sync, ``dlrover_plugin_ppo.trainer.push_weights`` (what
  ``PPOTrainer.sync_weights`` runs: for a model on the GPU, ``share_weights`` on actor
  rank 0 and ``set_weights_shared`` on every rollout rank, which map the actor's
  tensors over CUDA IPC; for a CPU model, or the ranks that cannot map them,
  ``get_weights`` on actor rank 0 and ``set_weights`` with the ``DRef``);
- ``raw``: the actor ``ray.put`` s its state dict (copied to the host first when it is
  on the GPU) and returns the reference, every rollout rank ``ray.get`` s it and copies
  each tensor into its model's parameters.

``--device cuda``: the actor and the rollout ranks share one GPU (each asks Ray for
``1 / (1 + max(--workers))`` of it), as collocated roles do, and the models live on it.

After each transfer every rollout rank's parameters are compared with the actor's (a
BLAKE2b digest of the bytes); a mismatch raises ``AssertionError``. One untimed transfer
each way per configuration comes first. Throughput: ``size * N`` bytes delivered over the
seconds from the call to the last rank's return, in GiB/s (2**30 bytes).

The last stdout line is one JSON object: ``sizes_mib``, ``workers``, ``repetitions``,
``tensor_mib``, ``device``, ``verified`` (true: every transfer matched) and ``configs``,
one per (size, N): ``mib``, ``n``, ``ours_gib_s`` and ``raw_gib_s`` (``{"median",
"min", "max"}``), ``ratio`` (median ours / median raw), each side's seconds per
repetition, and ``ours_transport`` (how the rollouts said the weights arrived:
``cuda_ipc`` or ``host``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from dlrover_plugin_ppo.workloads import ActorWorkload, RolloutWorkload, unwrap


class Blob(torch.nn.Module):
    """``nbytes`` of float32 parameters in tensors of at most ``tensor_bytes``."""

    def __init__(self, nbytes: int, tensor_bytes: int) -> None:
        super().__init__()
        n, per = nbytes // 4, max(1, tensor_bytes // 4)
        self.chunks = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(min(per, n - i))) for i in range(0, n, per))


class _Model:
    """The methods both sides' workloads share."""

    policy: torch.nn.Module

    def setup(self) -> None:
        torch.set_num_threads(1)
        self.policy = Blob(4, 4)

    def build(self, nbytes: int, tensor_bytes: int, device: str = "cpu") -> int:
        """A fresh zero model on ``device``; returns its bytes."""
        self.policy = Blob(nbytes, tensor_bytes).to(device)
        return sum(p.numel() * p.element_size() for p in self.policy.parameters())

    def digest(self) -> str:
        """BLAKE2b of the parameters' bytes, in order."""
        h = hashlib.blake2b()
        for v in unwrap(self.policy).state_dict().values():
            h.update(v.contiguous().cpu().numpy().tobytes())
        return h.hexdigest()


class SyncActor(_Model, ActorWorkload):
    def fill(self, seed: int) -> str:
        """New random parameter values; returns their digest."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.policy.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return self.digest()

    def put_raw(self) -> list:
        """The raw side: one ``ray.put`` of the state dict, on the host (a list, so the
        reference is passed on unresolved)."""
        import ray

        return [ray.put({k: v.to("cpu") for k, v in unwrap(self.policy).state_dict().items()})]


class SyncRollout(_Model, RolloutWorkload):
    def get_raw(self, refs: list) -> int:
        """The raw side: ``ray.get`` the state dict and copy it into the parameters."""
        import ray

        weights = ray.get(refs[0])
        with torch.no_grad():
            for k, p in unwrap(self.policy).state_dict(keep_vars=True).items():
                p.copy_(weights[k])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(weights)

    def transport(self) -> str | None:
        return self.weights_transport


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3)}


def positive(kind: type, name: str):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = None
        if v is None or v <= 0:
            raise argparse.ArgumentTypeError(f"{name}={text!r}; allowed: a number > 0")
        return v
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=positive(float, "--sizes-mib"), nargs="+",
                   default=[64.0, 256.0])
    p.add_argument("--workers", type=positive(int, "--workers"), nargs="+", default=[1, 2])
    p.add_argument("--repetitions", type=positive(int, "--repetitions"), default=3)
    p.add_argument("--tensor-mib", type=positive(float, "--tensor-mib"), default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device=cuda: torch sees no CUDA device here")

    import ray

    from dlrover_core.master.client import init_ray
    from dlrover_core.runtime import RoleGroup
    from dlrover_core.testing import spawn_role
    from dlrover_plugin_ppo.trainer import push_weights, shares_weights

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.chdir(root)  # the actors import benchmarks.weight_sync from the repository root
    if root not in sys.path:
        sys.path.insert(0, root)
    temp_dir = tempfile.mkdtemp(prefix="dlrbench", dir="/tmp")
    init_ray(None, num_cpus=max(4, max(args.workers) + 1), _temp_dir=temp_dir)
    rng = random.Random(args.seed)
    seeds = iter(range(args.seed, args.seed + 10**9))
    configs = []
    try:
        gpus = 1 / (1 + max(args.workers)) if args.device == "cuda" else 0
        actor_h = spawn_role("actor", "benchmarks.weight_sync:SyncActor", 1,
                             num_gpus=gpus)[0]
        rollout_h = spawn_role("rollout", "benchmarks.weight_sync:SyncRollout",
                               max(args.workers), num_gpus=gpus)
        actor = RoleGroup("actor", [actor_h])
        for mib in args.sizes_mib:
            nbytes = int(mib * 2**20) // 4 * 4
            tensor_bytes = int(args.tensor_mib * 2**20)
            sizes = ray.get([h.call.remote("build", nbytes, tensor_bytes, args.device)
                             for h in [actor_h, *rollout_h]])
            assert set(sizes) == {nbytes}, sizes
            for n in args.workers:
                hosts = rollout_h[:n]
                rollout = RoleGroup("rollout", hosts)

                share = shares_weights(actor)  # as PPOTrainer asks at its first sync

                def ours() -> None:
                    push_weights(actor, [rollout], share=share)

                def raw() -> None:
                    outer = actor_h.call.remote("put_raw")
                    ray.get([h.call.remote("get_raw", outer) for h in hosts])

                sides = {"ours": ours, "raw": raw}
                secs: dict[str, list[float]] = {k: [] for k in sides}
                transports: set = set()
                for rep in range(args.repetitions + 1):  # the first is untimed
                    order = list(sides)
                    rng.shuffle(order)
                    for side in order:
                        want = ray.get(actor_h.call.remote("fill", next(seeds)))
                        t0 = time.perf_counter()
                        sides[side]()
                        dt = time.perf_counter() - t0
                        got = ray.get([h.call.remote("digest") for h in hosts])
                        assert got == [want] * n, \
                            f"{side}, {mib:g} MiB to {n}: the rollouts' weights differ"
                        if rep:
                            secs[side].append(dt)
                        if side == "ours":
                            transports.update(ray.get([h.call.remote("transport")
                                                       for h in hosts]))
                gib = {k: [nbytes * n / 2**30 / s for s in v] for k, v in secs.items()}
                cfg = {"mib": mib, "n": n, "ours_gib_s": spread(gib["ours"]),
                       "raw_gib_s": spread(gib["raw"]),
                       "ratio": round(statistics.median(gib["ours"])
                                      / statistics.median(gib["raw"]), 3),
                       "ours_s": [round(s, 4) for s in secs["ours"]],
                       "raw_s": [round(s, 4) for s in secs["raw"]],
                       "ours_transport": sorted(transports)}
                print(f"{mib:g} MiB -> {n} rollout(s): {json.dumps(cfg)}", flush=True)
                configs.append(cfg)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    result: dict[str, Any] = {
        "sizes_mib": args.sizes_mib, "workers": args.workers,
        "repetitions": args.repetitions, "tensor_mib": args.tensor_mib,
        "device": args.device, "verified": True,
        "configs": configs}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
