"""Elastic roles in the job spec: ``roles.<role>.nodes`` (torchrun's ``--nnodes``
``MIN:MAX``) and the job's ``elastic`` section (called by the spec loader).

``nodes`` is ``"MIN:MAX"`` (quote it in YAML: YAML 1.1 reads an unquoted ``1:4`` as
the base-60 number 64), ``"N"`` or ``N`` (a fixed count), or ``{min: MIN, max: MAX}``.
A role with a node range runs on ``MIN`` to ``MAX`` nodes of ``per_node`` ranks each;
it starts at ``total`` ranks, which must be ``k * per_node`` for a ``k`` in the range.
Every error is a ``SpecError`` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from dlrover_core.spec.errors import SpecError

_RANGE = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")
_ALLOWED = "'MIN:MAX' (torchrun's --nnodes, e.g. \"1:4\"), 'N', N, or {min: MIN, max: MAX}"


@dataclass(frozen=True)
class NodeRange:
    """``min_nodes`` to ``max_nodes`` nodes of ``per_node`` ranks."""

    min_nodes: int
    max_nodes: int
    per_node: int

    @property
    def min_ranks(self) -> int:
        return self.min_nodes * self.per_node

    @property
    def max_ranks(self) -> int:
        return self.max_nodes * self.per_node


def parse_nodes(value: Any, key: str = "nodes") -> tuple[int, int]:
    """``(min_nodes, max_nodes)`` of a ``nodes`` value (see the module doc).

    Raises:
        SpecError: not one of the allowed forms, ``MIN < 1`` or ``MIN > MAX``.
    """
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool):
        raise SpecError(key, value, _ALLOWED)
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, dict):
        unknown = set(value) - {"min", "max"}
        if unknown or "min" not in value or "max" not in value:
            raise SpecError(key, value, _ALLOWED, "a mapping needs exactly min and max")
        try:
            lo, hi = int(value["min"]), int(value["max"])
        except (TypeError, ValueError):
            raise SpecError(key, value, _ALLOWED) from None
    elif isinstance(value, str) and (m := _RANGE.match(value)):
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
    else:
        raise SpecError(key, value, _ALLOWED)
    if lo < 1:
        raise SpecError(key, value, _ALLOWED + " with MIN >= 1")
    if lo > hi:
        raise SpecError(key, value, _ALLOWED + " with MIN <= MAX", f"MIN {lo} > MAX {hi}")
    return lo, hi


def node_range(spec: Any, role: str) -> NodeRange | None:
    """The node range of ``role`` (``None`` when it has no ``nodes``)."""
    r = spec.roles[role]
    value = r.get("nodes")
    if value is None:
        return None
    lo, hi = parse_nodes(value, f"roles.{role}.nodes")
    return NodeRange(lo, hi, int(r.per_node or r.total))


def validate_elastic(spec: Any) -> None:
    """Check every role's ``nodes`` and the ``elastic`` section.

    Raises:
        SpecError: a bad range; ``total`` not ``k * per_node`` for a ``k`` in the range; a
            range on a role without ``per_node``, without a backend, in a collocation
            group or in a job with a driver; ``elastic.global_batch`` and ``micro_batch``
            that do not go together.
    """
    e = spec.elastic  # its timeouts' ranges are declared and checked with the schema
    if e.global_batch < 0 or e.micro_batch < 0 or bool(e.global_batch) != bool(e.micro_batch):
        raise SpecError("elastic.global_batch", [e.global_batch, e.micro_batch],
                        "both elastic.global_batch and elastic.micro_batch > 0, or both 0")
    collocated = {r for g in spec.collocation for r in g}
    for role, r in spec.roles.items():
        if e.global_batch and r.get("backend") and r.get("total") and \
                e.global_batch % (e.micro_batch * r.total):
            raise SpecError("elastic.global_batch", e.global_batch,
                            f"a multiple of elastic.micro_batch x roles.{role}.total = "
                            f"{e.micro_batch} x {r.total} (every role with a backend gets "
                            "global_batch / (micro_batch x its world size) accumulation "
                            "steps)")
        if r.get("nodes") is None:
            continue
        k = f"roles.{role}.nodes"
        lo, hi = parse_nodes(r.nodes, k)
        if not r.per_node:
            raise SpecError(f"roles.{role}.per_node", r.per_node,
                            "an integer >= 1 on a role with a node range (ranks per node)")
        if not r.backend:
            raise SpecError(k, r.nodes, "a node range only on a role with a backend "
                            "(a process group that can be re-formed at another size)")
        if role in collocated:
            raise SpecError(k, r.nodes, "a node range only on a role outside collocation")
        if spec.driver is not None:
            raise SpecError(k, r.nodes, "a node range only in a job without a driver "
                            "(an SPMD job); not supported with a driver yet")
        per_node = int(r.per_node)
        if r.total % per_node or not lo <= r.total // per_node <= hi:
            hint = " (an unquoted 1:4 in YAML reads as 64: quote it)" \
                if isinstance(OmegaConf.to_container(spec.roles[role]).get("nodes"), int) else ""
            raise SpecError(f"roles.{role}.total", r.total,
                            f"k x per_node={per_node} for k in nodes {lo}..{hi}: "
                            + ", ".join(str(n * per_node) for n in range(lo, min(hi, lo + 7) + 1))
                            + hint)
