"""Weights handed between processes on one GPU without leaving it (CUDA IPC).

When the actor's policy lives on a CUDA device and a rollout (or reference) rank runs
on the same node and sees the same GPU (``collocation: [[actor, rollout]]`` with
fractional ``resources.gpu``), the weight sync need not copy the tensors to the host,
through Ray's object store and back: :meth:`SharedWeights.export` turns each tensor
into a CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``, which
calls the CUDA runtime's ``cudaIpcGetMemHandle`` on the tensor's allocation and
records an event for the writes still in flight), a few hundred bytes per tensor go
through Ray, and the receiver maps the actor's memory (``cudaIpcOpenMemHandle``) and
copies it into its own parameters on the device. verl hands weights from its trainer
to a collocated inference engine the same way.

The handles are valid only on the exporting node, for a process that sees the same
GPU under the same device index (the index is part of the handle):
:meth:`SharedWeights.openable` says whether this process can open them; otherwise the
sync falls back to the host copy (:func:`dlrover_plugin_ppo.trainer.push_weights`).
The exporting process must keep the tensors alive and unchanged until every receiver
has copied them; ``push_weights`` waits for that before the actor's next update.
"""

from __future__ import annotations

from typing import Any

import torch


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray: no node to share with
        return None


class SharedWeights:
    """A state dict left in the exporting process's GPU memory, as CUDA IPC handles.

    Attributes:
        handles: ``{name: (rebuild function, args)}`` from ``reduce_tensor`` (empty
            tensors travel as CPU tensors instead: there is no allocation to share).
        node_id: the exporting process's Ray node id (hex).
        device_uuid: ``str(torch.cuda.get_device_properties(i).uuid)`` of its GPU.
        device_index: the GPU's index in the exporting process.
        nbytes: the tensors' bytes (int).
    """

    def __init__(self, handles: dict[str, Any], node_id: str | None, device_uuid: str,
                 device_index: int, nbytes: int) -> None:
        self.handles = handles
        self.node_id = node_id
        self.device_uuid = device_uuid
        self.device_index = device_index
        self.nbytes = nbytes

    @classmethod
    def export(cls, state_dict: dict[str, torch.Tensor]) -> SharedWeights | None:
        """Handles for every tensor of ``state_dict``, or ``None`` when they are not all
        on one CUDA device (a CPU policy: the host path is the only one). Frees first the
        handles that earlier exports' receivers have released
        (``torch.cuda.ipc_collect``)."""
        tensors = [t for t in state_dict.values() if isinstance(t, torch.Tensor)]
        if len(tensors) != len(state_dict) or not tensors:
            return None
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return None
        from torch.multiprocessing.reductions import reduce_tensor

        device = next(iter(devices))
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.ipc_collect()
        handles: dict[str, Any] = {}
        for name, t in state_dict.items():
            t = t.detach()
            handles[name] = ("cpu", t.cpu()) if t.numel() == 0 else reduce_tensor(t)
        return cls(handles, _node_id(), str(torch.cuda.get_device_properties(index).uuid),
                   index, sum(t.numel() * t.element_size() for t in tensors))

    def openable(self) -> bool:
        """Whether this process can map the handles: same Ray node, CUDA available, and
        the exporter's GPU visible here under the same index."""
        if self.node_id is None or self.node_id != _node_id():
            return False
        if not torch.cuda.is_available() or self.device_index >= torch.cuda.device_count():
            return False
        return str(torch.cuda.get_device_properties(self.device_index).uuid) == self.device_uuid

    def open(self) -> dict[str, torch.Tensor]:
        """The exporter's tensors, mapped into this process (views of its memory: copy
        them, then drop them). Call only when :meth:`openable`."""
        out = {}
        for name, h in self.handles.items():
            if h[0] == "cpu":
                out[name] = h[1].to(f"cuda:{self.device_index}")
            else:
                rebuild, args = h
                out[name] = rebuild(*args)
        return out
