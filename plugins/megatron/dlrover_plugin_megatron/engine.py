"""The ``megatron`` state-dict engine: model and optimizer state from megatron-core's
sharded state dict (``dist_checkpointing``), as tensors the savers can reshard.

``objects``:

- ``model``: a megatron-core module with ``sharded_state_dict()`` (``MegatronModule``,
  ``GPTModel``, or a module built from ``ColumnParallelLinear`` / ``RowParallelLinear``
  / ``VocabParallelEmbedding`` under a ``MegatronModule``), possibly wrapped in DDP,
  or a list of them (virtual-pipeline chunks);
- ``optimizer`` (optional): a ``torch.optim`` optimizer over the model's parameters;
  its per-parameter state is keyed by the parameter's global name and sharded like
  the parameter, so it moves between layouts with it;
- any other entry (dicts of step, data position, RNG state) as the plain engine does.

The state dict::

    {"model": {name: DTensor | Tensor},                 # see dlrover_plugin_megatron.sharding
     "optimizer": {"state": {name: {"exp_avg": ..., "step": ...}},
                   "param_groups": [{"lr": ..., "betas": ..., ...}]},   # without "params"
     ...other objects}

Layouts: a checkpoint written at one TP/PP layout loads at another (TP=2 -> TP=1 and
back, another PP split of the layers, another world size) through both savers. The
``disk`` saver (torch.distributed.checkpoint) reads the chunks the new layout asks
for. The ``flash`` saver keeps each rank's local shard with its place in the global
tensor and, when the layout differs, fills each live tensor from the saved shards
that overlap it (``dlrover_plugin_flashckpt.reshard``): from memory when every saved
rank's buffer is on the loading node, else from its files on disk.
"""

from __future__ import annotations

from typing import Any

import torch

from dlrover_core.checkpoint.engine import StateDictEngineBase
from dlrover_plugin_megatron.sharding import (
    Placement,
    TensorParallelMesh,
    UnsupportedShardingError,
    local_of,
    placement_of,
    saveable,
)


def _split(objects: dict[str, Any]) -> tuple[list[Any], Any, dict[str, Any]]:
    model = objects.get("model")
    models = list(model) if isinstance(model, (list, tuple)) else ([model] if model is not None
                                                                   else [])
    rest = {k: v for k, v in objects.items() if k not in ("model", "optimizer")}
    return models, objects.get("optimizer"), rest


def _unwrap(model: Any) -> Any:
    """The module with megatron-core's ``sharded_state_dict`` (through DDP wrappers)."""
    m = model
    while not hasattr(m, "sharded_state_dict") and hasattr(m, "module"):
        m = m.module
    if not hasattr(m, "sharded_state_dict"):
        raise TypeError(f"the megatron state-dict engine needs objects['model'] to be a "
                        f"megatron-core module with sharded_state_dict() (a MegatronModule), "
                        f"got {type(model).__name__}")
    return m


class _Entry:
    __slots__ = ("placement", "tensor")

    def __init__(self, placement: Placement, tensor: torch.Tensor) -> None:
        self.placement, self.tensor = placement, tensor


def model_entries(models: list[Any]) -> tuple[dict[str, _Entry], dict[str, Any]]:
    """``(name -> entry of a live tensor, name -> extra object)`` of ``models`` from
    their megatron-core sharded state dicts.

    Raises:
        UnsupportedShardingError: a layout the engine cannot express.
        ValueError: two chunks hold the same global tensor.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factories,
    )

    tp_size = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    tensors: dict[str, _Entry] = {}
    extras: dict[str, Any] = {}
    for model in models:
        sharded = _unwrap(model).sharded_state_dict(metadata=metadata)
        apply_factories(sharded)
        for v in nested_values(sharded):
            if isinstance(v, ShardedTensor):
                p = placement_of(v, tp_size, tp_rank)
                if p.axis is None and tp_size > 1 and getattr(v.data, "tensor_model_parallel",
                                                              False):
                    raise UnsupportedShardingError(
                        f"{v.key} is a tensor-parallel parameter but the sharded state dict "
                        "calls it whole: a plain torch container (ModuleList, ModuleDict, "
                        "Sequential) between megatron modules hides the split; make the "
                        "container a MegatronModule")
                if p.name in tensors:
                    raise ValueError(f"two model chunks hold {p.name!r}")
                tensors[p.name] = _Entry(p, v.data)
            elif isinstance(v, ShardedObject):
                if v.data is not None:  # megatron's layers give None as their extra state
                    extras[f"{v.key}@{'.'.join(map(str, v.global_offset))}"] = v.data
            else:
                raise UnsupportedShardingError(
                    f"{type(v).__name__} in the sharded state dict is not supported")
    return tensors, extras


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the per-parameter state of an optimizer that has not stepped yet (a fresh
    one about to load a checkpoint), so the state has tensors to load into: one step
    with zero gradients and a learning rate of 0 (parameters are unchanged), then the
    learning rates are put back and the gradients cleared."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    saved_grads = {p: p.grad for p in params}
    try:
        for g in optimizer.param_groups:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = saved_grads[p]


def _copy_in(live: torch.Tensor, loaded: Any, name: str) -> None:
    src = local_of(loaded)
    if not isinstance(src, torch.Tensor):
        raise KeyError(f"checkpoint has no tensor for {name!r}")
    if src.data_ptr() == live.data_ptr() and src.shape == live.shape:
        return  # the saver loaded in place
    if src.shape != live.shape:
        raise ValueError(f"{name}: checkpoint has shape {tuple(src.shape)}, the live tensor "
                         f"{tuple(live.shape)}")
    with torch.no_grad():
        live.copy_(src)


class MegatronEngine(StateDictEngineBase):
    """See the module docstring."""

    def __init__(self) -> None:
        self._mesh = TensorParallelMesh()
        self._mesh_group: Any = None

    def _tp_mesh(self) -> TensorParallelMesh:
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        if group is not self._mesh_group:  # the groups were re-formed after a failure
            self._mesh, self._mesh_group = TensorParallelMesh(), group
        return self._mesh

    def state_dict(self, objects: dict[str, Any]) -> dict:
        models, optimizer, rest = _split(objects)
        out = super().state_dict(rest)
        if not models:
            return out
        mesh = self._tp_mesh()
        tensors, extras = model_entries(models)
        out["model"] = {n: saveable(e.tensor, e.placement, mesh) for n, e in tensors.items()}
        if extras:
            out["model_extra"] = extras
        if optimizer is not None:
            out["optimizer"] = self._optimizer_state(optimizer, tensors, mesh)
        return out

    def _optimizer_state(self, optimizer: torch.optim.Optimizer, tensors: dict[str, _Entry],
                         mesh: TensorParallelMesh) -> dict:
        init_optimizer_state(optimizer)
        by_param = {id(e.tensor): (n, e.placement) for n, e in tensors.items()}
        state: dict[str, dict] = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in by_param:
                    raise UnsupportedShardingError(
                        f"an optimizer parameter of shape {tuple(p.shape)} is not in the "
                        "model's sharded state dict; give the engine the optimizer of "
                        "objects['model']")
                name, placement = by_param[id(p)]
                entry = {}
                for k, v in optimizer.state[p].items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        entry[k] = saveable(v, placement, mesh)
                    elif isinstance(v, torch.Tensor):
                        entry[k] = v.detach()
                    else:
                        entry[k] = v
                state[name] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, objects: dict[str, Any], state_dict: dict) -> None:
        models, optimizer, rest = _split(objects)
        super().load_state_dict(rest, state_dict)
        if not models:
            return
        if "model" not in state_dict:
            raise KeyError(f"checkpoint has no entry 'model'; it has: {', '.join(state_dict)}")
        tensors, _ = model_entries(models)
        saved = state_dict["model"]
        for name, e in tensors.items():
            if name not in saved:
                raise KeyError(f"checkpoint has no model tensor {name!r}")
            _copy_in(e.tensor, saved[name], f"model.{name}")
        if optimizer is None:
            return
        if "optimizer" not in state_dict:
            raise KeyError("checkpoint has no entry 'optimizer' (saved without one?)")
        osd = state_dict["optimizer"]
        init_optimizer_state(optimizer)
        by_param = {id(e.tensor): n for n, e in tensors.items()}
        for g in optimizer.param_groups:
            for p in g["params"]:
                name = by_param[id(p)]
                saved_entry = osd["state"].get(name)
                if saved_entry is None:
                    raise KeyError(f"checkpoint has no optimizer state for {name!r}")
                live = optimizer.state[p]
                for k, v in saved_entry.items():
                    if isinstance(live.get(k), torch.Tensor):
                        _copy_in(live[k], v, f"optimizer.state.{name}.{k}")
                    else:
                        live[k] = local_of(v)
        groups = osd.get("param_groups", [])
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(groups)} optimizer param groups, the "
                             f"optimizer {len(optimizer.param_groups)}")
        for live_g, saved_g in zip(optimizer.param_groups, groups):
            for k, v in saved_g.items():
                live_g[k] = v
