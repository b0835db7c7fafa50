"""The meta block of a flash save: step, tensor table, skeleton and extra values as
tagged JSON behind a fixed header (:func:`pack_meta`, :func:`unpack_meta`).

JSON has no tuples, bytes, non-string keys, sets, dtypes or numpy values; those are
tagged objects ``{"$<tag>": ...}``. A block is never pickled, so reading a planted or
corrupted one cannot run code. The tensor table and skeleton themselves are
:mod:`.layout`'s.
"""

from __future__ import annotations

import base64
import json
import struct
import types
import zlib
from collections import OrderedDict, namedtuple
from typing import Any

from dlrover_plugin_flashckpt.layout import (
    DTYPE_NAMES,
    SavedObject,
    TensorEntry,
    TensorRef,
    dtype_name,
    path_str,
    to_dtype,
    type_name,
)

#: first bytes of a meta block; then ``<version u32><crc32 u32><length u64>`` and JSON
META_MAGIC = b"DLRMETA1"
META_VERSION = 1
_META_HDR = struct.Struct("<8sIIQ")


class MetaFormatError(ValueError):
    """A meta block is not in the format of :func:`pack_meta` (wrong magic, version or
    crc32, a truncated block, or a value of a type the format has no tag for)."""


def _encode(value: Any, path: tuple) -> Any:
    """``value`` as JSON data; tuples, bytes, non-string keys and the few non-JSON types
    a state dict holds are tagged objects ``{"$<tag>": ...}`` (see :func:`pack_meta`)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # an IntEnum or a bool-like int subclass: its value
    if isinstance(value, float):
        return float(value)
    if isinstance(value, TensorRef):
        return {"$ref": value.index}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        pairs = [[_encode(k, path + (k,)), _encode(v, path + (k,))] for k, v in value.items()]
        if isinstance(value, OrderedDict):
            return {"$odict": pairs}
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: v for (k, _), (_, v) in zip(value.items(), pairs)}
        return {"$dict": pairs}
    if isinstance(value, list):
        return [_encode(v, path + (i,)) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        items = [_encode(v, path + (i,)) for i, v in enumerate(value)]
        if hasattr(value, "_fields"):  # a namedtuple: rebuilt with its name and fields
            return {"$ntuple": [type(value).__name__, list(value._fields), items]}
        return {"$tuple": items}
    if isinstance(value, (set, frozenset)):
        return {"$set" if isinstance(value, set) else "$fset":
                [_encode(v, path) for v in value]}
    kind = type(value)
    if kind.__module__ == "torch" and kind.__name__ == "dtype":
        return {"$dtype": dtype_name(value)}
    if kind.__module__ == "torch" and kind.__name__ == "device":
        return {"$device": str(value)}
    if kind.__module__ == "numpy" and hasattr(value, "dtype") and not value.dtype.hasobject:
        import numpy as np

        raw = np.asarray(value)  # tobytes() is C order whatever the strides
        return {"$ndarray" if kind.__name__ == "ndarray" else "$npscalar":
                [raw.dtype.str, list(raw.shape), base64.b64encode(raw.tobytes()).decode()]}
    if (hasattr(value, "__dict__") and not callable(value)
            and not isinstance(value, (type, types.ModuleType))):
        # a plain object (DeepSpeed's LossScaler): its attributes only; a load sets them
        # on the live object of the same type, it never creates one (no import, no code)
        return {"$object": [type_name(kind), _encode(dict(vars(value)), path)]}
    raise TypeError(
        f"the flash saver cannot save {path_str(path)} of type {kind.__module__}."
        f"{kind.__qualname__}: the non-tensor part of a state dict may hold None, bool, int, "
        "float, str, bytes, lists, tuples (named too), sets, dicts, torch dtypes and "
        "devices, numpy arrays and scalars, and plain objects with a __dict__ (its meta "
        "block is JSON, never pickle); convert the value to one of those")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) != 1 or not next(iter(value)).startswith("$"):
        return {k: _decode(v) for k, v in value.items()}
    (tag, arg), = value.items()
    if tag == "$ref":
        return TensorRef(int(arg))
    if tag == "$bytes":
        return base64.b64decode(arg)
    if tag in ("$dict", "$odict"):
        pairs = [(_hashable(_decode(k)), _decode(v)) for k, v in arg]
        return OrderedDict(pairs) if tag == "$odict" else dict(pairs)
    if tag == "$tuple":
        return tuple(_decode(v) for v in arg)
    if tag == "$ntuple":
        name, names, items = arg
        return namedtuple(name, names)(*(_decode(v) for v in items))
    if tag in ("$set", "$fset"):
        items = [_hashable(_decode(v)) for v in arg]
        return set(items) if tag == "$set" else frozenset(items)
    if tag == "$object":
        return SavedObject(str(arg[0]), _decode(arg[1]))
    if tag == "$dtype":
        if arg not in DTYPE_NAMES:
            raise MetaFormatError(f"unknown dtype {arg!r} in a meta block")
        return to_dtype(arg)
    if tag == "$device":
        import torch

        return torch.device(str(arg))
    if tag in ("$ndarray", "$npscalar"):
        import numpy as np

        dt = np.dtype(str(arg[0]))
        if dt.hasobject:
            raise MetaFormatError(f"numpy dtype {arg[0]!r} holds Python objects")
        arr = np.frombuffer(base64.b64decode(arg[2]), dtype=dt).reshape(arg[1]).copy()
        return arr if tag == "$ndarray" else arr[()]
    raise MetaFormatError(f"unknown tag {tag!r} in a meta block")


def _hashable(v: Any) -> Any:
    return tuple(_hashable(x) for x in v) if isinstance(v, list) else v


def pack_meta(step: int, table: list[TensorEntry], skeleton: Any, extra: dict) -> bytes:
    """The meta block saved beside the data: step, tensor table, skeleton, ``extra``.

    Layout: ``META_MAGIC`` (8 bytes), version (u32), crc32 of the body (u32), body
    length (u64), all little-endian, then the body: UTF-8 JSON. Values JSON lacks are
    tagged objects (``{"$tuple": [...]}``, ``{"$bytes": base64}``, ...; see
    ``_encode``). It is never pickled, so reading a planted or corrupted block cannot
    run code.

    Raises:
        TypeError: a non-tensor value of a type the format has no tag for (the message
            names its path and type).
    """
    body = {"step": step, "table": [[_encode(e.path, ()), e.dtype, list(e.shape), e.offset,
                                     e.nbytes, e.kind, list(e.global_shape),
                                     list(e.global_offset)] for e in table],
            "skeleton": _encode(skeleton, ()),
            "extra": _encode(extra, ())}
    blob = json.dumps(body, separators=(",", ":"), allow_nan=True).encode()
    return _META_HDR.pack(META_MAGIC, META_VERSION, zlib.crc32(blob), len(blob)) + blob


def unpack_meta(blob: bytes | memoryview) -> dict:
    """Inverse of :func:`pack_meta`: ``{"step", "table", "skeleton", **extra}``.

    Raises:
        MetaFormatError: wrong magic (a block of another format, e.g. an older pickled
            one, which is never unpickled), unknown version, truncated block, crc32
            mismatch, or an unknown tag.
    """
    blob = bytes(blob)
    if len(blob) < _META_HDR.size:
        raise MetaFormatError(f"meta block of {len(blob)} bytes is shorter than its header")
    magic, version, crc, n = _META_HDR.unpack_from(blob, 0)
    if magic != META_MAGIC:
        raise MetaFormatError(f"meta block starts with {magic!r}, not {META_MAGIC!r}: not a "
                              "flash meta block of this version (older pickled blocks are "
                              "never unpickled)")
    if version != META_VERSION:
        raise MetaFormatError(f"meta block version {version}; this code reads {META_VERSION}")
    body = blob[_META_HDR.size:_META_HDR.size + n]
    if len(body) != n or zlib.crc32(body) != crc:
        raise MetaFormatError("meta block is truncated or its crc32 does not match")
    try:
        d = json.loads(body)
        table = [TensorEntry(_hashable(_decode(p)), str(dt), tuple(sh), int(off), int(nb),
                             str(kind), tuple(gs), tuple(go))
                 for p, dt, sh, off, nb, kind, gs, go in d["table"]]
        out = {"step": d["step"], "table": table, "skeleton": _decode(d["skeleton"])}
        extra = _decode(d["extra"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MetaFormatError(f"meta block is malformed: {exc}") from None
    out.update(extra)
    return out


