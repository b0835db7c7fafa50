"""Restore a flash checkpoint into another world size or layout (FSDP2 / DCP state,
DDP state, tensor- and pipeline-parallel state such as the megatron engine's).

A save of world size ``W`` holds, per rank, the local shard of every ``DTensor`` with
its place in the global tensor (``TensorEntry.global_shape`` and ``global_offset``,
the ``(local shape, global offset)`` that
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` gives, as
torch.distributed.checkpoint records for its chunks), and every other value as that
rank had it. A rank ``r`` of a new world size ``W'`` (or of ``W`` in another layout:
TP=2 -> TP=1 x DP=2) loads:

- each live ``DTensor`` (its local shard, placed by the same function on the live
  mesh): from every saved shard of that path that overlaps it, box by box (along
  dim 0 for FSDP2's ``Shard(0)``: each overlap is a run of whole rows, read straight
  into the live shard); the overlaps must cover it. A tensor saved whole (TP=1) fills
  a live shard the same way;
- a live plain tensor of a path saved sharded (TP=2 -> TP=1): the same, over the
  whole tensor;
- a saved sharded tensor the live state lacks (the optimizer state of an optimizer
  that has not stepped yet): as a plain tensor with the local layout of a live
  ``DTensor`` of the same global shape (FSDP2 shards every tensor of one global shape
  alike);
- plain tensors (replicated state, a DDP model, scalars such as Adam's ``step``) and
  non-tensor values: from saved rank ``r % W`` ("base rank"); a path the base rank
  lacks (another pipeline stage's layers) from the lowest saved rank that has it.

Partitions that are not ``DTensor``s (DeepSpeed ZeRO's flat partitions) cannot be
placed and are refused with :class:`layout.LayoutError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from dlrover_plugin_flashckpt import layout
from dlrover_plugin_flashckpt.layout import (  # noqa: F401 - global_offset: re-exported
    LayoutError,
    TensorEntry,
    TensorRef,
    global_offset,
    path_str,
)

if TYPE_CHECKING:
    import torch

#: paths of rank-local partitions that only the same world size can restore
_PARTITION_KEYS = ("single_partition_of_fp32_groups", "base_optimizer_state")


@dataclass
class RankSource:
    """One saved rank of the checkpoint being resharded.

    Attributes:
        rank: the saved rank. meta: its unpacked meta block (``table``, ``skeleton``).
        read: ``read(entry, byte_offset, dst)`` fills the contiguous CPU tensor ``dst``
            with the entry's bytes from ``byte_offset`` on.
        submit: like ``read``, but may return before ``dst`` is filled (reads of every
            overlap then run at once, in the reader's threads); the caller of
            :func:`restore_resharded` waits for them. ``None``: ``read``.
    """

    rank: int
    meta: dict
    read: Callable[[TensorEntry, int, "torch.Tensor"], None]
    submit: Callable[[TensorEntry, int, "torch.Tensor"], None] | None = None

    def fill(self, e: TensorEntry, offset: int, dst: torch.Tensor) -> None:
        """Start filling ``dst``, a tensor of the live state nothing reads before the
        restore ends (``submit`` when given, else ``read``)."""
        (self.submit or self.read)(e, offset, dst)

    def whole(self, e: TensorEntry) -> torch.Tensor:
        import torch

        t = torch.empty(e.shape, dtype=layout.to_dtype(e.dtype))
        self.read(e, 0, t)
        return t


def local_region(t: Any) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, global shape, global offset of the local tensor)`` of a live
    tensor (a plain tensor is its own global tensor)."""
    if layout.is_dtensor(t):
        return t.to_local(), tuple(t.shape), global_offset(t)
    return t, tuple(t.shape), (0,) * t.dim()


def _copy_boxes(dst: torch.Tensor, dst_off: tuple[int, ...], shape: tuple[int, ...],
                pieces: list[tuple[RankSource, TensorEntry]], where: str) -> None:
    """Fill ``dst`` (the part ``[dst_off, dst_off + dst.shape)`` of a global tensor of
    ``shape``) from the saved shards ``pieces`` that overlap it."""
    dshape = tuple(dst.shape)
    covered = 0
    for src, e in pieces:
        soff = tuple(e.global_offset) or (0,) * len(e.shape)
        if tuple(e.global_shape or e.shape) != shape:
            raise LayoutError(f"{where}: {path_str(e.path)} has global shape "
                              f"{list(e.global_shape or e.shape)} in saved rank {src.rank}, "
                              f"{list(shape)} in the live state")
        lo = [max(a, b) for a, b in zip(soff, dst_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(soff, e.shape, dst_off, dshape)]
        if any(h <= lw for lw, h in zip(lo, hi)) and dshape:
            continue
        n = math.prod(h - lw for lw, h in zip(lo, hi))
        covered += n
        if not dshape:
            src.read(e, 0, dst)
            continue
        rows_whole = all(lo[d] == soff[d] == dst_off[d] and hi[d] == soff[d] + e.shape[d]
                         == dst_off[d] + dshape[d] for d in range(1, len(dshape)))
        part = dst.narrow(0, lo[0] - dst_off[0], hi[0] - lo[0])
        if rows_whole and part.is_contiguous():
            row = math.prod(e.shape[1:]) * part.element_size()
            src.fill(e, (lo[0] - soff[0]) * row, part)
            continue
        whole = src.whole(e)
        sl_src = tuple(slice(lw - o, h - o) for lw, h, o in zip(lo, hi, soff))
        sl_dst = tuple(slice(lw - o, h - o) for lw, h, o in zip(lo, hi, dst_off))
        dst[sl_dst].copy_(whole[sl_src])
    if covered < dst.numel():
        raise LayoutError(f"{where}: the saved shards cover {covered} of the {dst.numel()} "
                          f"elements of the live shard at offset {list(dst_off)}")


class _SourcedRef:
    """A :class:`TensorRef` of saved rank ``rank``'s table (see :func:`_union`)."""

    __slots__ = ("rank", "index")

    def __init__(self, rank: int, index: int) -> None:
        self.rank, self.index = rank, index


def _tag(saved: Any, rank: int) -> Any:
    """``saved`` (a skeleton) with each :class:`TensorRef` tagged with ``rank``."""
    if isinstance(saved, TensorRef):
        return _SourcedRef(rank, saved.index)
    if isinstance(saved, dict):
        return {k: _tag(v, rank) for k, v in saved.items()}
    if isinstance(saved, list):
        return [_tag(v, rank) for v in saved]
    if isinstance(saved, tuple):
        vals = [_tag(v, rank) for v in saved]
        return type(saved)(*vals) if hasattr(saved, "_fields") else tuple(vals)
    return saved


def _union(into: Any, other: Any, rank: int) -> Any:
    """Add to the tagged skeleton ``into`` the dict keys that only ``other`` (saved rank
    ``rank``'s skeleton) has: the layers of another pipeline stage, the embedding of
    the first stage. Values both have stay ``into``'s."""
    if isinstance(into, dict) and isinstance(other, dict):
        for k, v in other.items():
            into[k] = _union(into[k], v, rank) if k in into else _tag(v, rank)
    return into


def restore_resharded(template: Any, sources: list[RankSource], rank: int, where: str) -> Any:
    """Load the save of ``len(sources)`` ranks into ``template`` (the live state of
    rank ``rank`` of this world size, which may differ from the saved one, or of the
    same world size in another layout) in place; returns the root. Reads started with
    a source's ``submit`` may still run: the caller waits for them before using it.

    Each live tensor is filled from the saved shards of its path that overlap it (from
    whichever saved ranks hold that path: pipeline stages hold different layers), or,
    for a tensor saved whole, from the base rank ``rank % len(sources)`` when it holds
    it, else from the lowest saved rank that does. A tensor saved whole also fills a
    live ``DTensor`` shard of it (a TP=1 save loading at TP=2).

    Raises:
        LayoutError: a tensor's global shape or dtype differs, a live shard is not
            covered by the saved shards, a live tensor is in no saved rank, or the
            save holds rank-local partitions (DeepSpeed ZeRO) that cannot be resharded.
    """
    import torch

    sources = sorted(sources, key=lambda s: s.rank)
    if [s.rank for s in sources] != list(range(len(sources))):
        raise LayoutError(f"{where}: saved ranks {[s.rank for s in sources]} are not all "
                          f"ranks 0..{len(sources) - 1}")
    base = sources[rank % len(sources)]
    by_path = [{e.path: e for e in s.meta["table"]} for s in sources]
    for s in sources:
        for e in s.meta["table"]:
            if any(k in e.path for k in _PARTITION_KEYS):
                raise LayoutError(f"{where}: {path_str(e.path)} is a rank-local optimizer "
                                  "partition (DeepSpeed ZeRO); it restores only into the world "
                                  f"size and layout that saved it ({len(sources)} ranks)")
    layout.check_covered(template, set().union(*by_path), where)
    live_layouts: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for _, t in layout.walk(template):
        if layout.is_dtensor(t):
            local, shape, off = local_region(t)
            live_layouts.setdefault(shape, (tuple(local.shape), off))

    def pieces(e: TensorEntry) -> list[tuple[RankSource, TensorEntry]]:
        out = []
        for s, index in zip(sources, by_path):
            pe = index.get(e.path)
            if pe is None:
                continue  # another pipeline stage, or a rank without this shard
            if pe.kind != "dtensor":
                raise LayoutError(f"{where}: {path_str(e.path)} is sharded in one saved "
                                  f"rank but whole in saved rank {s.rank}")
            out.append((s, pe))
        return out

    def load_tensor(live: Any, e: TensorEntry, src: RankSource) -> Any:
        if e.kind != "dtensor":  # saved whole (replicated, rank-local, or TP=1)
            if live is None:
                return src.whole(e)
            dst, gshape, off = local_region(live)
            if layout.dtype_name(dst.dtype) != e.dtype:
                raise LayoutError(f"{where}: {path_str(e.path)} is {e.dtype} in saved rank "
                                  f"{src.rank} but {layout.dtype_name(dst.dtype)} in the live "
                                  "state")
            if tuple(dst.shape) == e.shape:
                src.fill(e, 0, dst)
            elif layout.is_dtensor(live) and gshape == e.shape:  # a shard of the whole
                _copy_boxes(dst, off, gshape, [(src, e)], where)
            else:
                raise LayoutError(f"{where}: {path_str(e.path)} is {e.dtype}{list(e.shape)} in "
                                  f"saved rank {src.rank} but {layout.dtype_name(dst.dtype)}"
                                  f"{list(dst.shape)} in the live state")
            return live
        shape = tuple(e.global_shape)
        if live is None:
            if shape not in live_layouts:
                raise LayoutError(f"{where}: {path_str(e.path)} is sharded in the save and the "
                                  "live state has no sharded tensor of its global shape "
                                  f"{list(shape)} to take the layout from")
            lshape, off = live_layouts[shape]
            dst = torch.empty(lshape, dtype=layout.to_dtype(e.dtype))
            _copy_boxes(dst, off, shape, pieces(e), where)
            return dst
        dst, gshape, off = local_region(live)
        if layout.dtype_name(dst.dtype) != e.dtype:
            raise LayoutError(f"{where}: {path_str(e.path)} is {e.dtype} in the checkpoint but "
                              f"{layout.dtype_name(dst.dtype)} in the live state")
        _copy_boxes(dst, off, gshape, pieces(e), where)
        return live

    def load_ref(live: Any, ref: _SourcedRef) -> Any:
        src = sources[ref.rank]
        return load_tensor(live if layout.is_tensor(live) else None,
                           src.meta["table"][ref.index], src)

    skeleton = _tag(base.meta["skeleton"], base.rank)
    for s in sources:
        if s is not base:
            skeleton = _union(skeleton, s.meta["skeleton"], s.rank)
    with torch.no_grad():
        return layout.merge_saved(template, skeleton, where, _SourcedRef, load_ref)
