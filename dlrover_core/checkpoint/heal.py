"""Healing replicated ranks from a survivor's live state: no checkpoint, no step redone.

When every rank of a role holds the whole training state (DDP: the backend session's
``replicated_state`` is true), a rank that replaces a failed one does not need a
checkpoint: a survivor, set up again in its own process, still holds the model, the
optimizer and what else its workload last gave :meth:`Checkpointer.maybe_save` (or
``save``), at the step it last completed. The master asks for a heal when it re-forms a
role with survivors in place (``RecoveryExecutor.restart_role``) in a job without a
driver (with a driver, its last commit is the point every role goes back to); then the first
``Checkpointer.load()`` of each rank's ``setup()`` runs :func:`heal` instead of reading
a checkpoint (the way torchft heals a replica group from a healthy peer):

1. every rank says the step of the live state it holds (``-1``: none; a replacement, or
   a survivor whose parameters changed after its last ``maybe_save``, e.g. it failed
   between the optimizer step and the save); ``all_gather_object`` over the role's group;
2. the lowest rank holding the newest step is the source: it broadcasts the structure of
   its state dict (the backend's state-dict engine's, tensors left out) and its CPU RNG
   state with ``broadcast_object_list``, then the tensors, concatenated into one flat
   buffer per dtype, with ``broadcast``;
3. every rank loads that state into its new objects through the engine; a rank whose own
   live state is at that step takes its own CPU RNG state back, the others the source's
   (equal when the ranks seed alike, as DDP ranks do).

Nobody holding a live state (``-1`` everywhere) means no heal: ``load()`` reads the
checkpoint as before. What is tracked per ``maybe_save`` call (:class:`LiveTracker`):
references to the objects, a copy of the state of the small ones (dicts, samplers: not
modules or optimizers, whose parameters' version counters tell whether they moved on),
and the CPU RNG state: microseconds a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LiveState:
    """A survivor's training state at ``step`` (the engine's state dict, tensors still
    those of its old objects) and its CPU RNG state then (a ``torch.ByteTensor``)."""

    step: int
    state: dict
    rng: Any


def live_state_of(workload: Any) -> LiveState | None:
    """The live state of ``workload``'s checkpointer (``Checkpointer.live_state``), or
    ``None`` (no workload or checkpointer, nothing noted, or capturing it failed: the
    error is printed, and this rank offers no state to heal from)."""
    import traceback

    ck = getattr(workload, "_checkpointer", None)
    if ck is None:
        return None
    try:
        return ck.live_state()
    except Exception:  # noqa: BLE001 - no heal from this rank; say why
        traceback.print_exc()
        return None


def _is_big(obj: Any) -> bool:
    import torch

    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))


def _versions(objects: dict[str, Any]) -> tuple:
    """The version counters of every parameter of the modules among ``objects`` (an
    in-place update, such as an optimizer step, bumps them)."""
    import torch

    return tuple(p._version for obj in objects.values() if isinstance(obj, torch.nn.Module)
                 for p in obj.parameters())


class LiveTracker:
    """The newest state a rank handed to its checkpointer (see the module doc)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self._big: dict[str, Any] = {}
        self._small: dict = {}
        self._versions: tuple = ()
        self._rng: Any = None

    def note(self, step: int, objects: dict[str, Any], engine: Any) -> None:
        """``objects`` are the state of ``step`` (called by every ``maybe_save`` and
        ``save``, whether it saves or not)."""
        import torch

        self._big = {k: v for k, v in objects.items() if _is_big(v)}
        self._small = engine.state_dict({k: v for k, v in objects.items() if k not in self._big})
        self._versions = _versions(self._big)
        self._rng = torch.get_rng_state()
        self.step = int(step)

    def capture(self, engine: Any) -> LiveState | None:
        """The tracked state, or ``None`` when nothing was noted or a parameter changed
        since (the objects are past the noted step)."""
        if self.step is None or _versions(self._big) != self._versions:
            return None
        state = dict(self._small)
        state.update(engine.state_dict(self._big))
        return LiveState(self.step, state, self._rng)


class _Slot:
    """Where a tensor was in a state dict sent without its tensors."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _strip(obj: Any, tensors: list) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def heal(live: LiveState | None, engine: Any, objects: dict[str, Any],
         device: Any) -> tuple[int, int] | None:
    """Collective over the default process group (every rank of the role calls it, see
    the module doc): load the newest live state any rank holds into ``objects`` through
    ``engine``. ``live``: this rank's (``None``: none); ``device``: the ``torch.device``
    the process group communicates on (CPU for gloo, the rank's GPU for NCCL); tensors
    elsewhere travel in the pickled header. Returns ``(step, source rank)``, or ``None``
    when no rank holds a live state (``objects`` untouched)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    steps: list = [None] * world
    dist.all_gather_object(steps, live.step if live is not None else -1)
    best = max(steps)
    if best < 0:
        return None
    src = steps.index(best)
    header: list = [None, None, None]
    tensors: list = []
    if rank == src:
        assert live is not None
        skeleton = _strip(live.state, tensors)
        meta = [(tuple(t.shape), t.dtype) if t.device.type == device.type
                else t.detach().cpu().clone() for t in tensors]
        header = [skeleton, meta, live.rng]
    dist.broadcast_object_list(header, src=src, device=device)
    skeleton, meta, rng = header
    by_dtype: dict = {}
    for i, m in enumerate(meta):
        if isinstance(m, tuple):
            by_dtype.setdefault(m[1], []).append(i)
    received: list = [m if not isinstance(m, tuple) else None for m in meta]
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        idx = by_dtype[dtype]
        sizes = [int(torch.Size(meta[i][0]).numel()) for i in idx]
        if rank == src:
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx]) if idx else None
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        dist.broadcast(flat, src=src)
        for i, part in zip(idx, torch.split(flat, sizes)):
            received[i] = part.view(meta[i][0])
    engine.load_state_dict(objects, _fill(skeleton, received))
    own = live is not None and live.step == best
    if (live.rng if own else rng) is not None:
        torch.set_rng_state(live.rng if own else rng)
    return best, src
