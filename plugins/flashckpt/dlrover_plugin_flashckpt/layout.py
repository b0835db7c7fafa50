"""State dict <-> raw bytes: the tensor table, the skeleton, and the in-place load.

A state dict is a nested structure of dicts, lists and tuples whose leaves are
tensors (``torch.Tensor`` or ``DTensor``) and small picklable values. Saving splits
it into

- the **tensor table**: one :class:`TensorEntry` per tensor leaf, in walk order, with
  the dtype and shape of the bytes written (a ``DTensor`` contributes its local
  shard, ``to_local()``) and the byte offset in the data area;
- the **skeleton**: the same structure with every tensor replaced by a
  :class:`TensorRef` (its index in the table); it carries every non-tensor value
  (step, RNG state tuples, data position, optimizer hyper-parameters) and is stored as
  tagged JSON (:func:`.meta.pack_meta`), never pickled.

The data area is the tensors' raw bytes, each at a 64-byte aligned offset, with no
pickling of tensor data. Loading walks the saved skeleton and the live state dict
together: a live tensor of the same dtype and shape receives the bytes in place; a
missing one is created; any other difference raises.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch

ALIGN = 64

#: dtypes a table can name; ``str(torch.float32)`` -> ``"float32"``
DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                "uint8", "uint16", "uint32", "uint64", "bool", "complex64", "complex128",
                "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


class LayoutError(ValueError):
    """A saved state does not fit the live state dict (other model or world size)."""


@dataclass(frozen=True)
class TensorRef:
    """Placeholder of a tensor in a skeleton: its index in the tensor table."""

    index: int


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a layout.

    Attributes:
        path: keys from the root of the state dict (``("model", "layers.0.w")``).
        dtype: dtype name (``"float32"``). shape: shape of the bytes written (the local
            shard of a ``DTensor``). offset: byte offset in the data area.
        nbytes: ``numel * element_size``. kind: ``tensor`` or ``dtensor``.
        global_shape: the ``DTensor``'s global shape (``()`` for plain tensors).
        global_offset: where the local shard starts in the global tensor (``()`` for
            plain tensors); with ``global_shape`` it lets :mod:`.reshard` restore into
            another world size.
    """

    path: tuple
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    kind: str = "tensor"
    global_shape: tuple[int, ...] = ()
    global_offset: tuple[int, ...] = ()

    def describe(self) -> str:
        return f"{path_str(self.path)} {self.dtype}{list(self.shape)}"


def path_str(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise TypeError(f"dtype {dtype} is not supported by the flash saver; supported: "
                        + ", ".join(DTYPE_NAMES))
    return name


def to_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "to_local")


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    return _is_dtensor(value)


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (a ``DTensor`` too)."""
    return _is_tensor(value)


def local_tensor(value: Any) -> torch.Tensor:
    """The tensor whose bytes are saved: the local shard of a ``DTensor``."""
    return value.to_local() if _is_dtensor(value) else value


def global_offset(t: Any) -> tuple[int, ...]:
    """Offset of a ``DTensor``'s local shard in the global tensor: the offset that
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` gives.

    For ``Shard``, ``Replicate`` and ``Partial`` placements it is computed from
    ``Shard.local_shard_size_and_offset`` alone (:func:`shard_region`); torch's function
    builds an index tensor as long as the sharded dim (0.03 s for a 16M-element dim),
    so it only serves the other placements (``_StridedShard``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is not None:
        region = shard_region(tuple(t.shape), tuple(mesh.shape), coordinate, t.placements)
        if region is not None:
            return region[1]
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    return tuple(int(o) for o in offset)


def shard_region(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                 coordinate: Any, placements: Any) -> tuple[tuple[int, ...],
                                                            tuple[int, ...]] | None:
    """``(local shape, global offset)`` of the shard at mesh ``coordinate`` of a tensor of
    ``global_shape`` placed by ``placements`` (``torch.chunk``'s split, shard after shard
    from the first mesh dim, as torch's ``_compute_local_shape_and_global_offset``; an
    empty shard's offset is the dim's size), or ``None`` when a placement is neither
    ``Shard``, ``Replicate`` nor ``Partial``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    local, offset = list(global_shape), [0] * len(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, (Replicate, Partial)):
            continue
        if type(p) is not Shard:
            return None
        size, start = Shard.local_shard_size_and_offset(local[p.dim], mesh_shape[mesh_dim],
                                                        int(coordinate[mesh_dim]))
        offset[p.dim] = global_shape[p.dim] if size == 0 else offset[p.dim] + int(start)
        local[p.dim] = int(size)
    return tuple(local), tuple(offset)


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def walk(state: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """Yield ``(path, tensor)`` for every tensor leaf, in a fixed order."""
    if _is_tensor(state):
        yield path, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from walk(v, path + (k,))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from walk(v, path + (i,))


def _check_plain(path: tuple, t: torch.Tensor) -> None:
    import torch

    if t.layout != torch.strided:
        raise TypeError(f"{path_str(path)}: {t.layout} tensors are not supported by the flash "
                        "saver (only dense strided tensors)")
    if t.device.type == "meta":
        raise TypeError(f"{path_str(path)}: a meta tensor has no data to save")


def build_table(state: Any) -> tuple[list[TensorEntry], list[torch.Tensor], Any]:
    """Split ``state`` into (tensor table, the tensors whose bytes are saved, skeleton).

    Raises:
        TypeError: a sparse or meta tensor, or an unsupported dtype (the message names
            the path).
    """
    table: list[TensorEntry] = []
    sources: list[torch.Tensor] = []
    offset = 0

    def conv(value: Any, path: tuple) -> Any:
        nonlocal offset
        if _is_tensor(value):
            kind = "dtensor" if _is_dtensor(value) else "tensor"
            t = local_tensor(value)
            _check_plain(path, t)
            nbytes = t.numel() * t.element_size()
            gshape, goff = (), ()
            if kind == "dtensor":
                gshape, goff = tuple(value.shape), global_offset(value)
            table.append(TensorEntry(path, dtype_name(t.dtype), tuple(t.shape), offset, nbytes,
                                     kind, gshape, goff))
            sources.append(t)
            offset += -(-nbytes // ALIGN) * ALIGN
            return TensorRef(len(table) - 1)
        if isinstance(value, dict):
            items = [(k, conv(v, path + (k,))) for k, v in value.items()]
            return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
        if isinstance(value, list):
            return [conv(v, path + (i,)) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(conv(v, path + (i,)) for i, v in enumerate(value))
        if isinstance(value, tuple):  # namedtuple
            return type(value)(*(conv(v, path + (i,)) for i, v in enumerate(value)))
        return value

    skeleton = conv(state, ())
    return table, sources, skeleton


def data_size(table: list[TensorEntry]) -> int:
    """Bytes of the data area of ``table`` (aligned)."""
    if not table:
        return 0
    last = table[-1]
    return last.offset + -(-last.nbytes // ALIGN) * ALIGN


def signature(table: list[TensorEntry]) -> bytes:
    """16-byte digest of the paths, dtypes and shapes of ``table`` (same digest: the same
    buffers can be reused)."""
    h = hashlib.blake2b(digest_size=16)
    for e in table:
        h.update(repr((e.path, e.dtype, e.shape, e.kind)).encode())
    return h.digest()


def type_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


@dataclass(frozen=True)
class SavedObject:
    """A plain object of a saved state: its type's name and its attributes. A load
    (:func:`restore`) sets the attributes on the live object of that type at the same
    place; it never imports nor creates a type."""

    type_name: str
    attrs: dict


def apply_object(live: Any, saved: SavedObject, where: str,
                 merge: Callable[[Any, Any], Any]) -> Any:
    """Set the saved attributes on ``live`` (an object of the saved type); returns it.

    Raises:
        LayoutError: ``live`` is missing or of another type.
    """
    if live is None or type_name(type(live)) != saved.type_name:
        raise LayoutError(
            f"{where}: the checkpoint holds a {saved.type_name} object where the live state "
            f"has {type(live).__name__}; a flash checkpoint sets the attributes of the live "
            "object, it never creates one")
    vars(live).update(merge(None, saved.attrs))
    return live


def tensor_view(buf: Any, base: int, entry: TensorEntry) -> torch.Tensor:
    """A tensor sharing memory with ``buf`` (an mmap or bytes-like) at ``base + offset``."""
    import torch

    dtype = to_dtype(entry.dtype)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=entry.nbytes, offset=base + entry.offset)
    return raw.view(dtype).view(entry.shape)


def check_covered(template: Any, saved_paths: set, where: str) -> None:
    """Raise :class:`LayoutError` when a tensor of the live ``template`` has no saved
    path (``where`` names the source)."""
    missing = [p for p, _ in walk(template) if p not in saved_paths]
    if missing:
        raise LayoutError(f"{where} has no tensor at {path_str(missing[0])} "
                          f"({len(missing)} live tensors are missing from it); it was saved "
                          "from another model")


def merge_saved(live: Any, saved: Any, where: str, ref_type: type,
                load: Callable[[Any, Any], Any]) -> Any:
    """Walk a saved skeleton ``saved`` and the live state ``live`` together; returns the
    (possibly new) live value. A placeholder of ``ref_type`` is handed to
    ``load(live value or None, placeholder)``; a :class:`SavedObject` sets its attributes
    on the live object (:func:`apply_object`); dicts and same-length lists are updated in
    place, tuples rebuilt (named ones with their type); other values are the saved ones.

    Raises:
        LayoutError: from ``load`` or :func:`apply_object`.
    """

    def merge(live: Any, saved: Any) -> Any:
        if isinstance(saved, ref_type):
            return load(live, saved)
        if isinstance(saved, SavedObject):
            return apply_object(live, saved, where, merge)
        if isinstance(saved, dict):
            if isinstance(live, dict):
                for k, v in saved.items():
                    live[k] = merge(live.get(k), v)
                return live
            return {k: merge(None, v) for k, v in saved.items()}
        if isinstance(saved, list):
            if isinstance(live, list) and len(live) == len(saved):
                for i, v in enumerate(saved):
                    live[i] = merge(live[i], v)
                return live
            return [merge(None, v) for v in saved]
        if isinstance(saved, tuple):
            same = isinstance(live, tuple) and len(live) == len(saved)
            lives = live if same else (None,) * len(saved)
            vals = [merge(a, b) for a, b in zip(lives, saved)]
            return type(saved)(*vals) if hasattr(saved, "_fields") else tuple(vals)
        return saved

    return merge(live, saved)


def restore(template: Any, skeleton: Any, table: list[TensorEntry],
            source: Callable[[TensorEntry], torch.Tensor] | None, where: str,
            fill: Callable[[TensorEntry, torch.Tensor], None] | None = None) -> Any:
    """Load a saved state into ``template`` in place; returns the (possibly new) root.

    ``source(entry)`` returns a CPU tensor with the saved bytes of one table entry;
    or ``fill(entry, dst)`` writes them into ``dst`` (a tensor of the entry's dtype
    and shape) itself, e.g. with :class:`reader.ShardReader`.
    Live tensors (their local shard for a ``DTensor``) of the same dtype and shape are
    overwritten in place; dicts and lists are updated in place; saved entries the
    template lacks are created (cloned); non-tensor values are taken from the save.

    Raises:
        LayoutError: a live tensor differs in dtype or shape from the saved one, or the
            template has a tensor the save does not have (``where`` names the source).
    """
    check_covered(template, {e.path for e in table}, where)

    def load(live: Any, ref: TensorRef) -> Any:
        e = table[ref.index]
        if _is_tensor(live):
            dst = local_tensor(live)
            if dtype_name(dst.dtype) != e.dtype or tuple(dst.shape) != e.shape:
                raise LayoutError(
                    f"{where}: {path_str(e.path)} is {e.dtype}{list(e.shape)} in the "
                    f"checkpoint but {dtype_name(dst.dtype)}{list(dst.shape)} in the live "
                    "state; a flash checkpoint restores in place into the same model "
                    "and layout")
            if e.global_shape and _is_dtensor(live):
                if (tuple(live.shape), global_offset(live)) != (e.global_shape,
                                                                e.global_offset):
                    raise LayoutError(
                        f"{where}: {path_str(e.path)} is the shard at "
                        f"{list(e.global_offset)} of {list(e.global_shape)} in the "
                        f"checkpoint but the one at {list(global_offset(live))} of "
                        f"{list(live.shape)} in the live state")
            if fill is not None:
                fill(e, dst)
            else:
                assert source is not None
                dst.copy_(source(e))
            return live
        if fill is not None:
            t = torch.empty(e.shape, dtype=to_dtype(e.dtype))
            fill(e, t)
            return t
        assert source is not None
        return source(e).clone()

    import torch

    with torch.no_grad():
        return merge_saved(template, skeleton, where, TensorRef, load)
