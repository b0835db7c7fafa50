"""megatron-core sharded state dicts -> tensors that dlrover's savers can reshard.

``module.sharded_state_dict()`` (megatron-core ``dist_checkpointing``) describes each
local tensor by the global tensor it belongs to: ``key``, ``global_shape``,
``global_offset``, ``axis_fragmentations`` and ``replica_id``. This module turns
each such ``ShardedTensor`` into

- a ``DTensor`` with ``Shard(axis)`` on a 1-D device mesh of the tensor-parallel
  group, when the tensor is split along one axis by tensor parallelism (column- and
  row-parallel weights, vocab-parallel embeddings and output layers);
- the local tensor itself, when it is whole on every rank (layer norms, biases of
  row-parallel layers, position embeddings): its replicas are equal.

Both share memory with the live parameter, so loading into them loads in place.
``torch.distributed.checkpoint`` (the ``disk`` saver) stores every chunk with its
global offset and reads whatever chunks a new layout asks for: a TP=2 checkpoint
loads at TP=1 and back, in any world size. The ``flash`` saver stores each rank's
local shard (``DTensor.to_local()``) with its global shape and offset, and reshards
the same way when the layout differs.

Stacked layers (``prepend_axis_num > 0``, megatron-core's ``decoder.layers.*`` in
``GPTModel``) are split into one tensor per layer, named ``<key>#<layer>`` with the
global layer index, so a checkpoint also moves between pipeline layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Placement:
    """Where one local tensor sits in its global tensor.

    Attributes:
        name: the saved name (megatron key, plus ``#<layer>`` for stacked layers).
        global_shape: shape of the global tensor (without stacked-layer axes).
        axis: the tensor-parallel split axis, or ``None`` when the tensor is whole.
        parts: number of parts along ``axis`` (the tensor-parallel size).
    """

    name: str
    global_shape: tuple[int, ...]
    axis: int | None
    parts: int


class UnsupportedShardingError(NotImplementedError):
    """A sharded tensor whose layout this engine cannot express (say which)."""


def placement_of(st: Any, tp_size: int, tp_rank: int) -> Placement:
    """The :class:`Placement` of a megatron-core ``ShardedTensor``.

    Raises:
        UnsupportedShardingError: a flattened (distributed-optimizer) shard, a split
            along more than one axis, or a split that is not the tensor-parallel one.
    """
    if getattr(st, "flattened_range", None) is not None:
        raise UnsupportedShardingError(
            f"{st.key}: flattened shards (megatron's distributed optimizer) are not "
            "supported; use a torch optimizer over the model's parameters")
    n = st.prepend_axis_num
    name = st.key if n == 0 else st.key + "#" + ".".join(str(o) for o in st.global_offset[:n])
    shape = tuple(st.global_shape[n:])
    offset = tuple(st.global_offset[n:])
    frags = tuple(st.axis_fragmentations[n:]) if st.axis_fragmentations else (1,) * len(shape)
    local = tuple(st.data.shape)
    split = [a for a, f in enumerate(frags) if f > 1]
    if not split:
        if local != shape:
            raise UnsupportedShardingError(f"{st.key}: local shape {local} differs from the "
                                           f"global {shape} but no axis is split")
        return Placement(name, shape, None, 1)
    if len(split) > 1:
        raise UnsupportedShardingError(f"{st.key}: split along axes {split}; only one "
                                       "tensor-parallel axis is supported")
    a = split[0]
    if frags[a] != tp_size or offset[a] != tp_rank * local[a] or shape[a] != tp_size * local[a]:
        raise UnsupportedShardingError(
            f"{st.key}: split into {frags[a]} parts along axis {a} at offset {offset[a]}; "
            f"only even tensor-parallel splits (TP={tp_size}, this rank {tp_rank}) are supported")
    return Placement(name, shape, a, tp_size)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


class TensorParallelMesh:
    """The 1-D ``DeviceMesh`` of this rank's tensor-parallel group (built once)."""

    def __init__(self) -> None:
        self._mesh: Any = None

    def get(self) -> Any:
        if self._mesh is None:
            from megatron.core import parallel_state as ps
            from torch.distributed.device_mesh import DeviceMesh

            device = "cuda" if torch.cuda.is_available() else "cpu"
            self._mesh = DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), device)
        return self._mesh


def saveable(local: torch.Tensor, placement: Placement, mesh: TensorParallelMesh) -> Any:
    """``local`` (detached, same storage) as a DTensor on the TP mesh, or itself."""
    t = local.detach()
    if placement.axis is None:
        return t
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t, mesh.get(), [Shard(placement.axis)], run_check=False,
                              shape=torch.Size(placement.global_shape),
                              stride=_contiguous_stride(placement.global_shape))


def local_of(value: Any) -> Any:
    """The local tensor of a saved value (a DTensor's shard, or the value itself)."""
    return value.to_local() if hasattr(value, "to_local") else value
