"""Failures Megatron users meet, and the failover level each one gets.

``classify`` answers ``dlrover_classify_failure`` before the built-in classifier
(``None`` for anything it does not know):

| failure (message of the exception or of Ray's death cause) | level |
| --- | --- |
| megatron-core refusing parallel sizes: ``world_size (..) is not divisible by ..``, ``num_attention_heads (..) must be a multiple of tensor_model_parallel_size``, ``num_query_groups .. must be a multiple ..``, ``.. must be divisible by virtual pipeline``, ``X is not divisible by Y`` from ``megatron.core.utils.divide`` | ``fatal`` |
| NCCL collective timeout or watchdog abort (``Watchdog caught collective operation timeout``, ``ProcessGroupNCCL``'s abort, ``NCCL communicator was aborted``, ``ncclSystemError`` / ``ncclRemoteError`` / ``ncclInternalError``) | ``process``; ``node`` the third time on the same node |
| CUDA illegal memory access (``an illegal memory access was encountered``, ``cudaErrorIllegalAddress``) | ``process`` (the CUDA context is lost, the process must go); ``node`` the second time on the same node; ``fatal`` the second time at the same step on different nodes (a kernel bug, not a GPU fault) |

The sizes are also checked when the spec loads (:mod:`dlrover_plugin_megatron.settings`);
the ``fatal`` rule catches sizes that only the model code knows.
"""

from __future__ import annotations

import re

from dlrover_core.plugins.records import Failure, FailureVerdict

SIZE_PATTERNS = (
    re.compile(r"world_size \(\d+\) is not divisible by"),
    re.compile(r"num_attention_heads \(\d+\) must be a multiple of tensor_model_parallel_size"),
    re.compile(r"num_query_groups \(\d+\) must be a multiple"),
    re.compile(r"must be divisible by virtual pipeline"),
    re.compile(r"must be divisible by\s+pipeline|pipeline_model_parallel_size"
               r".*(?:divisible|multiple)"),
    re.compile(r"^\d+ is not divisible by \d+$", re.MULTILINE),
)

NCCL_MARKERS = (
    "Watchdog caught collective operation timeout", "collective operation timeout",
    "NCCL communicator was aborted", "ProcessGroupNCCL", "ncclSystemError", "ncclRemoteError",
    "ncclInternalError", "NCCL timeout", "NCCL error",
)

ILLEGAL_ACCESS_MARKERS = ("an illegal memory access was encountered", "cudaErrorIllegalAddress",
                          "CUDA error: an illegal memory access")

NCCL_NODE_THRESHOLD = 3
ILLEGAL_ACCESS_NODE_THRESHOLD = 2


def _text(f: Failure) -> str:
    return f"{f.message}\n{f.traceback}"


def _has(f: Failure, markers: tuple[str, ...]) -> bool:
    text = _text(f)
    return any(m in text for m in markers)


def _node_verdict(failure: Failure, history: list[Failure], markers: tuple[str, ...],
                  threshold: int, what: str, suspect: str) -> FailureVerdict | None:
    """``node`` when a failure with one of ``markers`` struck ``failure``'s node
    ``threshold`` times or more (this one and the earlier ones in ``history``), else
    ``None``; the reason names ``what`` happened and what is ``suspect``."""
    times = 1 + sum(1 for f in history if f.node_id and f.node_id == failure.node_id
                    and _has(f, markers))
    if times < threshold:
        return None
    return FailureVerdict("node", f"{what} on node {failure.node_id[:12]} {times} times "
                                  f"(this one included): {suspect}; moving its ranks to "
                                  "another node")


def _where(f: Failure) -> str:
    return f"{f.role}-{f.rank}" if f.role else "a rank"


def _size_error(f: Failure) -> str | None:
    text = _text(f)
    for pattern in SIZE_PATTERNS:
        m = pattern.search(text)
        if m:
            line = next((ln.strip() for ln in f.message.splitlines() if m.group(0) in ln),
                        m.group(0))
            return line[:200]
    return None


def classify(failure: Failure, history: list[Failure]) -> FailureVerdict | None:
    """The verdict for a Megatron failure (see the module docstring), else ``None``."""
    size = _size_error(failure)
    if size is not None:
        role = failure.role or "<role>"
        return FailureVerdict(
            "fatal",
            f"megatron-core refused the parallel sizes on {_where(failure)}: {size}; change "
            f"roles.{role}.config.tensor_parallel / pipeline_parallel / context_parallel (their "
            f"product must divide roles.{role}.total, and heads and layers must split evenly)")
    if _has(failure, ILLEGAL_ACCESS_MARKERS):
        node = _node_verdict(failure, history, ILLEGAL_ACCESS_MARKERS,
                             ILLEGAL_ACCESS_NODE_THRESHOLD, "CUDA illegal memory access",
                             "a faulty GPU is likely")
        if node is not None:
            return node
        same_step = [f for f in history if f.step == failure.step and f.step >= 0
                     and _has(f, ILLEGAL_ACCESS_MARKERS)]
        if same_step:
            return FailureVerdict(
                "fatal", f"CUDA illegal memory access at step {failure.step} again, on "
                "another node: a kernel or indexing bug (e.g. a token id >= the vocabulary "
                "size), not a GPU fault; run with CUDA_LAUNCH_BLOCKING=1 to find the kernel")
        return FailureVerdict(
            "process", f"CUDA illegal memory access on {_where(failure)} at step "
            f"{failure.step}: the CUDA context is lost, restarting the process from the "
            "last checkpoint")
    if _has(failure, NCCL_MARKERS):
        node = _node_verdict(failure, history, NCCL_MARKERS, NCCL_NODE_THRESHOLD,
                             "NCCL timeout or abort", "its network or GPUs are suspect")
        if node is not None:
            return node
        return FailureVerdict(
            "process", f"NCCL collective timed out or was aborted on {_where(failure)} at "
            f"step {failure.step} (a peer died, hung, or the network dropped); re-forming "
            "the group and resuming from the last checkpoint. If it recurs, check the "
            "node's network and raise failover.pg_timeout_s for slow steps")
    return None
