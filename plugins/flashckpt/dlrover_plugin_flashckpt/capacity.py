"""How large a rank's shared-memory buffers are made before its first save.

Allocating a buffer (``posix_fallocate`` on tmpfs: every page allocated and zeroed) and
filling its page tables costs far more than the copy of a save (measured here: about
2.5 s/GiB against 0.1-0.2 s/GiB), so the saver does it in a background thread before
the first save, from a size known early: ``checkpoint.options.reserve_mib``, or the
state dict that ``load()`` restores into at the start of training.

At that point a freshly built torch optimizer usually has no state yet (Adam creates
``exp_avg`` and ``exp_avg_sq`` at its first ``step()``), so the state of the first save
is larger than the template. :func:`estimate` adds what the optimizer will create,
from its ``param_groups`` (the tensors each torch optimizer keeps per parameter, as
listed in ``torch/optim/*.py``):

============================================== ==========================
optimizer (recognised by its hyper-parameters) state tensors per parameter
============================================== ==========================
Adam, AdamW, NAdam, RAdam, Adamax (``betas``)   2 (+1 with ``amsgrad``)
RMSprop (``alpha``)                             1 (+1 momentum, +1 centered)
SGD (``momentum``)                              1 when momentum > 0, else 0
Adadelta (``rho``)                              2
Adagrad (``lr_decay``) and any other            1
============================================== ==========================

plus one scalar ``step`` tensor per parameter. The parameter bytes are those of the
state's tensors outside the optimizer section, shared out over the parameters the
optimizer lists. A wrong estimate costs one slow save (the buffer grows then, and the
other buffers grow in the background); ``reserve_mib`` avoids it.
"""

from __future__ import annotations

from typing import Any, Iterator

from dlrover_plugin_flashckpt import layout
from dlrover_plugin_flashckpt.meta import pack_meta

#: bytes reserved per table entry a new optimizer tensor adds to the meta block
META_PER_ENTRY = 320


def _optimizer_sections(state: Any, path: tuple = ()) -> Iterator[tuple[tuple, dict]]:
    """``(path, section)`` of every optimizer state dict (a dict with ``state`` and a
    list ``param_groups``) inside ``state``."""
    if isinstance(state, dict):
        if isinstance(state.get("param_groups"), list) and isinstance(state.get("state"), dict):
            yield path, state
            return
        for k, v in state.items():
            yield from _optimizer_sections(v, path + (k,))


def tensors_per_param(group: dict) -> int:
    """State tensors (besides ``step``) a torch optimizer creates per parameter of
    ``group`` at its first step (see the module table)."""
    if "betas" in group:
        return 2 + int(bool(group.get("amsgrad", False)))
    if "alpha" in group:
        return 1 + int((group.get("momentum") or 0) > 0) + int(bool(group.get("centered")))
    if "momentum" in group:
        return int((group.get("momentum") or 0) > 0)
    if "rho" in group:
        return 2
    return 1


def estimate(state: Any, known: tuple[int, int] | None = None) -> tuple[int, int]:
    """``(data bytes, meta bytes)`` a save of ``state`` needs once its optimizers have
    created their state (see the module docstring; exact when they already have).

    Args:
        state: a state dict as a state-dict engine returns it (nested dicts, lists,
            tuples of tensors and small values).
        known: ``(data bytes, meta bytes)`` of a save of exactly this state's layout
            (a load that restored every tensor of it in place from a buffer: that
            save's data length and meta block): taken as the answer when no optimizer
            in ``state`` lacks state for a parameter, without building the state's table
            and meta block (a few ms for a model of hundreds of tensors, on the load's
            path); else the estimate is made as without it.
    Raises:
        TypeError: an unsupported tensor (as :func:`layout.build_table`).
    """
    sections = list(_optimizer_sections(state))
    if known is not None and not any(
            p not in section["state"] for _, section in sections
            for group in section["param_groups"] for p in group.get("params", [])):
        return known
    table, _, skeleton = layout.build_table(state)
    data = layout.data_size(table)
    meta = len(pack_meta(0, table, skeleton, {"rank": 0, "world_size": 1}))
    if not sections:
        return data, meta
    inside = {p for p, _ in sections}
    param_bytes = sum(e.nbytes for e in table
                      if not any(e.path[:len(p)] == p for p in inside))
    n_params = sum(len(g.get("params", [])) for _, s in sections for g in s["param_groups"])
    for _, section in sections:
        for group in section["param_groups"]:
            params = group.get("params", [])
            missing = [p for p in params if p not in section["state"]]
            if not missing or not n_params:
                continue
            k = tensors_per_param(group)
            share = param_bytes * len(missing) / n_params
            data += int(k * share) + len(missing) * (k + 1) * layout.ALIGN
            meta += len(missing) * (k + 1) * META_PER_ENTRY
    return data, meta
