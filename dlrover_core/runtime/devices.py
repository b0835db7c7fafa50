"""Which GPU a role instance uses (seed ``004``'s ``enable_ray_auto_visible_device``).

The device a rank computes on is always one that Ray reserved for it: the first of
``ray.get_gpu_ids()`` (the ids of its placement-group bundle), found in the process's
``CUDA_VISIBLE_DEVICES``. Two ranks share a GPU only when Ray gave both the same id,
which happens when the spec collocates roles (``collocation``) on fractions of one
GPU in one bundle. Two modes, chosen per role in the job spec, change only what the
process sees:

- **off** (default): dlrover asks Ray not to set ``CUDA_VISIBLE_DEVICES``
  (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` in the actor's environment), so
  every GPU of the node is visible and the rank computes on ``cuda:<its Ray GPU id>``
  (the id's position in ``CUDA_VISIBLE_DEVICES`` when the node's raylet was started
  with one). Collocated roles see the same device numbers, which CUDA IPC and a shared
  NCCL group need, and a promoted warm standby can take a GPU it did not reserve at
  start (see :mod:`dlrover_core.master.standby`).
- **on**: Ray sets ``CUDA_VISIBLE_DEVICES`` to the GPU ids it reserved for the actor;
  the instance sees only those and computes on ``cuda:0``.

Everything here is computed from Ray's assignment and the environment, never from
CUDA, so a cluster whose GPUs are Ray resources only (``ray.init(num_gpus=4)`` on a
CPU machine) checks it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def actor_env(gpu: float, ray_auto_visible_device: bool) -> dict[str, str]:
    """Environment variables for the actor of an instance asking for ``gpu`` GPUs:
    ``{NOSET_ENV: "1"}`` when it uses GPUs with the mode off, else ``{}``."""
    if gpu and not ray_auto_visible_device:
        return {NOSET_ENV: "1"}
    return {}


@dataclass(frozen=True)
class DeviceAssignment:
    """The GPU of one role instance.

    Attributes:
        gpu_ids: Ray's assignment (``ray.get_gpu_ids()`` as strings; ``[]``: none).
        visible_devices: the process's ``CUDA_VISIBLE_DEVICES`` (``None`` when unset).
        cuda_device: the CUDA device index the rank uses inside its own process
            (``None``: it computes on the CPU).
    """

    gpu_ids: list[str] = field(default_factory=list)
    visible_devices: str | None = None
    cuda_device: int | None = None

    @property
    def device(self) -> str:
        """``"cuda:<cuda_device>"`` or ``"cpu"``."""
        return "cpu" if self.cuda_device is None else f"cuda:{self.cuda_device}"

    def as_dict(self) -> dict:
        return {"gpu_ids": list(self.gpu_ids), "visible_devices": self.visible_devices,
                "cuda_device": self.cuda_device}


def assign_device(gpu_ids: list, environ: dict | None = None) -> DeviceAssignment:
    """The device of a process that Ray gave ``gpu_ids``: the first id's position in
    ``CUDA_VISIBLE_DEVICES`` when that is set, else the id itself (all GPUs of the
    node visible, numbered as Ray numbers them). No ids: the CPU.

    Raises:
        ValueError: the first id is not among ``CUDA_VISIBLE_DEVICES`` (the process
            cannot see the GPU Ray reserved), or is not an integer while
            ``CUDA_VISIBLE_DEVICES`` is unset.
    """
    env = os.environ if environ is None else environ
    ids = [str(i) for i in gpu_ids]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if not ids:
        return DeviceAssignment([], visible, None)
    if visible is None:
        if not ids[0].isdigit():
            raise ValueError(f"GPU id {ids[0]!r} from Ray is not an index and "
                             "CUDA_VISIBLE_DEVICES is unset; allowed: integer ids, or set "
                             "CUDA_VISIBLE_DEVICES on the node")
        return DeviceAssignment(ids, None, int(ids[0]))
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if ids[0] not in listed:
        raise ValueError(f"Ray assigned GPU {ids[0]!r} but CUDA_VISIBLE_DEVICES={visible!r} "
                         "does not list it; allowed: the assigned GPU must be visible "
                         "(unset CUDA_VISIBLE_DEVICES or list it)")
    return DeviceAssignment(ids, visible, listed.index(ids[0]))


def current_assignment(gpu_ids: list | None = None) -> DeviceAssignment:
    """:func:`assign_device` for this Ray worker process: ``gpu_ids`` when given (a
    promoted standby's lease on the failed rank's GPU), else ``ray.get_gpu_ids()``."""
    import ray

    return assign_device(ray.get_gpu_ids() if gpu_ids is None else gpu_ids)
