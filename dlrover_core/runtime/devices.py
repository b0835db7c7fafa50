"""Which GPU a role instance uses (seed ``004``'s ``enable_ray_auto_visible_device``).

Two modes, chosen per role in the job spec:

- **off** (default): dlrover asks Ray not to set ``CUDA_VISIBLE_DEVICES``
  (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` in the actor's environment), so
  every GPU of the node is visible to the instance and it computes on
  ``cuda:<local_rank % visible GPUs>``. Collocated roles with the same ``local_rank``
  (actor and rollout sharing a bundle) therefore see and pick the same device, which
  is what weight sharing through CUDA IPC or a shared NCCL group needs. Use it for
  SPMD roles and collocated roles.
- **on**: Ray's own assignment: Ray sets ``CUDA_VISIBLE_DEVICES`` to the GPU ids it
  reserved for the actor, the instance sees only those and computes on ``cuda:0``.
  Use it when instances of different jobs or roles must not see each other's GPUs
  (isolation), at the cost of collocated roles possibly seeing different ids.

Reservations are the same in both modes: the placement group bundle holds the GPUs
(fractions for collocated roles), so Ray never over-commits a device.
"""

from __future__ import annotations

import os

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def actor_env(gpu: float, ray_auto_visible_device: bool) -> dict[str, str]:
    """Environment variables for the actor of an instance asking for ``gpu`` GPUs:
    ``{NOSET_ENV: "1"}`` when it uses GPUs with the mode off, else ``{}``."""
    if gpu and not ray_auto_visible_device:
        return {NOSET_ENV: "1"}
    return {}


def visible_gpu_ids(node_gpus: int, environ: dict | None = None) -> list[str]:
    """GPU ids this process can see: ``CUDA_VISIBLE_DEVICES`` when set (``""`` is
    none), else all ``node_gpus`` of the node (``"0"`` .. ``str(node_gpus - 1)``)."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return [str(i) for i in range(int(node_gpus))]
    return [v for v in value.split(",") if v.strip() and v != "NoDevFiles"]


def device_index(local_rank: int, n_visible: int) -> int:
    """The CUDA device index an instance with ``local_rank`` computes on among
    ``n_visible`` visible GPUs (``local_rank % n_visible``).

    Raises:
        ValueError: ``n_visible`` < 1.
    """
    if n_visible < 1:
        raise ValueError(f"device_index: n_visible={n_visible}; allowed: >= 1 visible GPU")
    return local_rank % n_visible


def chosen_device(local_rank: int, gpu: float, node_gpus: int,
                  environ: dict | None = None) -> str:
    """``"cuda:<i>"`` for an instance that reserved GPUs (``gpu`` > 0) and sees some,
    else ``"cpu"``; computed from the environment, so it can be checked on a cluster
    whose GPUs are Ray resources only (``ray.init(num_gpus=4)`` on a CPU machine)."""
    ids = visible_gpu_ids(node_gpus, environ)
    if not gpu or not ids:
        return "cpu"
    return f"cuda:{device_index(local_rank, len(ids))}"
