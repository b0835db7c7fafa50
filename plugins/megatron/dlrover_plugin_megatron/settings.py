"""The ``megatron`` backend's settings and their checks. Imports no torch or megatron:
the spec loader calls :func:`validate_role` in the client before anything starts.

Settings are keys of the role's config (the job's ``config`` merged with the role's
``config``), named as the field names them::

    roles:
      trainer: {backend: megatron, total: 4, config: {tensor_parallel: 2}}
    config: {num_layers: 4, num_attention_heads: 4, ...}

| key | default | meaning |
| --- | --- | --- |
| ``tensor_parallel`` | 1 | TP size: ranks that split each weight matrix |
| ``pipeline_parallel`` | 1 | PP size: ranks that split the layers into stages |
| ``context_parallel`` | 1 | CP size; only 1 is accepted (see below) |
| ``virtual_pipeline`` | none | model chunks per pipeline rank; only none or 1 accepted |
| ``seed`` | 1234 | base seed; see :mod:`dlrover_plugin_megatron.seeding` |

The data-parallel size is what is left: ``world_size / (TP * PP * CP)``. When the
config also gives the model's ``num_layers``, ``num_attention_heads`` or
``num_query_groups``, their divisibility by the sizes is checked too (the same
constraints megatron-core asserts later, on every rank, after the processes started).

Context parallelism (CP > 1) and the virtual pipeline (> 1) are refused at spec load:
nothing in this backend splits the sequence or builds model chunks, and without a GPU
the megatron-core paths that would do it could not be tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dlrover_core.spec.errors import SpecError

SIZE_KEYS = ("tensor_parallel", "pipeline_parallel", "context_parallel")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class MegatronSettings:
    """Parallel sizes of one role (all >= 1; ``data_parallel`` derived)."""

    world_size: int
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    virtual_pipeline: int | None = None
    seed: int = 1234

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one replica of the model: ``TP * PP * CP``."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.model_parallel

    @classmethod
    def from_config(cls, config: Any, world_size: int, key_of: Any = None) -> MegatronSettings:
        """Read and check the settings in ``config`` (a mapping) for ``world_size`` ranks.

        Args:
            config: the role's merged config (dict or ``DictConfig``).
            world_size: ranks of the role (``roles.<role>.total``).
            key_of: ``(key) -> str``, the dotted spec key to name in errors
                (default ``config.<key>``).
        Raises:
            SpecError: a size that is not a positive integer, a world size not
                divisible by ``TP * PP * CP``, a virtual pipeline without PP > 1, a
                virtual pipeline > 1 or CP > 1 (not supported), or model dimensions not
                divisible by the sizes; the message names the
                key, the value and what is allowed.
        """
        key_of = key_of or (lambda k: f"config.{k}")

        def get_int(k: str, default: int | None, minimum: int) -> int | None:
            v = config.get(k, default) if hasattr(config, "get") else default
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise SpecError(key_of(k), v, f"an integer >= {minimum}")
            return v

        tp = get_int("tensor_parallel", 1, 1)
        pp = get_int("pipeline_parallel", 1, 1)
        cp = get_int("context_parallel", 1, 1)
        vpp = get_int("virtual_pipeline", None, 1)
        seed = get_int("seed", 1234, 0)
        mp = tp * pp * cp
        if world_size % mp:
            sizes = {"tensor_parallel": tp, "pipeline_parallel": pp, "context_parallel": cp}
            bad = next(k for k in SIZE_KEYS if sizes[k] != 1)  # mp > 1: one of them is
            raise SpecError(
                key_of(bad), sizes[bad],
                f"sizes whose product TP*PP*CP divides the role's world size {world_size} "
                f"(a divisor of {world_size}: {_divisors(world_size)})",
                f"TP={tp} * PP={pp} * CP={cp} = {mp} does not divide world size {world_size}")
        if vpp is not None and vpp > 1 and pp < 2:
            raise SpecError(key_of("virtual_pipeline"), vpp,
                            "none or 1 unless pipeline_parallel >= 2",
                            f"pipeline_parallel is {pp}: there is no pipeline to interleave")
        if vpp is not None and vpp > 1:
            raise SpecError(key_of("virtual_pipeline"), vpp, "none or 1",
                            "no schedule here uses model chunks: the interleaved schedule "
                            "(megatron-core's, on GPUs) needs a model built as chunks, which "
                            "this backend does not build and which cannot be tested without "
                            "a GPU")
        if cp > 1:
            raise SpecError(key_of("context_parallel"), cp, "1",
                            "nothing here splits the sequence over context-parallel ranks "
                            "(megatron-core's context parallelism runs inside its attention "
                            "on GPUs, untested here without a GPU)")
        layers = get_int("num_layers", None, 1)
        if layers is not None:
            stages = pp * (vpp or 1)
            if layers % stages:
                what = f"pipeline_parallel={pp}" + (f" * virtual_pipeline={vpp}" if vpp else "")
                raise SpecError(key_of("num_layers"), layers,
                                f"a multiple of {what} = {stages}",
                                f"{layers} layers cannot be split evenly into {stages} stages")
        for k in ("num_attention_heads", "num_query_groups"):
            n = get_int(k, None, 1)
            if n is not None and n % tp:
                raise SpecError(key_of(k), n, f"a multiple of tensor_parallel={tp}",
                                f"each of the {tp} tensor-parallel ranks must hold whole heads")
        hidden = get_int("hidden_size", None, 1)
        heads = get_int("num_attention_heads", None, 1)
        if hidden is not None and heads is not None and hidden % heads:
            raise SpecError(key_of("hidden_size"), hidden,
                            f"a multiple of num_attention_heads={heads}")
        return cls(world_size=world_size, tensor_parallel=tp, pipeline_parallel=pp,
                   context_parallel=cp, virtual_pipeline=vpp, seed=seed)


def validate_role(role: str, role_spec: dict, config: dict) -> None:
    """The ``Backend.validate_role`` of ``megatron``: check the role's sizes at spec load.

    Args:
        role: the role name. role_spec: ``roles.<role>`` as a plain dict (``total``,
            ``config``...). config: the job's ``config`` merged with the role's.
    Raises:
        SpecError: see :meth:`MegatronSettings.from_config`.
    """
    own = role_spec.get("config") or {}

    def key_of(k: str) -> str:
        return f"roles.{role}.config.{k}" if k in own else f"config.{k}"

    MegatronSettings.from_config(config, int(role_spec.get("total", 1)), key_of)
