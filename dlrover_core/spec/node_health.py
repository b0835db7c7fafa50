"""The ``node_health`` section of the job spec: the pre-flight node check, run-time
straggler detection and the stack capture of hung ranks (see docs/node-health.md).

Each field declares what it allows (:func:`~dlrover_core.spec.fields.spec_field`);
they are checked with the rest of the spec, and :func:`validate_node_health` checks the
rule of ``straggler_action: shrink``; every error names the key, the value and what
is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from dlrover_core.spec.elastic import parse_nodes
from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.fields import spec_field

#: What the master does with a straggler: ``off`` (no detection), ``report`` (the
#: ``straggler_detected`` event only), ``replace`` (the rank is replaced, from the warm
#: standby when there is one, like a failed rank), ``shrink`` (the straggler's node is
#: dropped from its elastic role: ``dlrover_core.master.elastic``).
STRAGGLER_ACTIONS = ("off", "report", "replace", "shrink")
#: How the stacks of hung ranks are captured: ``auto`` (py-spy when installed, else
#: faulthandler), ``py-spy``, ``faulthandler``, ``off``.
STACK_METHODS = ("auto", "py-spy", "faulthandler", "off")


@dataclass
class NodeHealthSpec:
    """Node health settings.

    Pre-flight check (before the ranks of roles with a process group start, on every
    GPU bundle of every node of their placement, or one bundle of a node without GPUs):
    ``skip_node_check`` turns it off; ``slow_factor`` (k): a node whose slowest
    device's matmul GFLOP/s is below the median of the other nodes' devices over k, or
    whose pair bandwidth is below the median over k in both rounds, is excluded;
    ``check_timeout_s``: seconds one step (matmul, or one pair's all-gather) may take
    before the node or pair fails. Sizes, on a GPU (bfloat16, timed with CUDA events):
    ``gpu_matmul_batch`` matrices of ``gpu_matmul_size`` x ``gpu_matmul_size`` per
    batched matmul, ``gpu_matmul_iters`` of them; all-gathers of ``gpu_allgather_mb``
    MiB per rank, ``gpu_allgather_iters`` timed after ``gpu_warmup_iters`` untimed
    (the matmul too). On a CPU (float32, host clock) the same code with
    ``matmul_batch`` x ``matmul_size`` x ``matmul_size``, ``matmul_iters``,
    ``allgather_kb`` KiB per rank, ``allgather_iters``, after ``warmup_iters``.

    Stragglers: ``straggler_action`` (:data:`STRAGGLER_ACTIONS`; ``shrink`` only when
    the roles are elastic: :func:`validate_node_health`); every
    ``straggler_window_s`` s, each rank's median ``compute_s`` (else ``step_s``) of its
    reports in the window is compared with the median of the other ranks of its role;
    a rank above ``straggler_factor`` times that, whose wait (``comm_wait_s``, else
    ``step_s - compute_s``) is not above the others', for ``straggler_windows`` windows
    in a row is a straggler (``dlrover_core.master.stragglers``).

    Hangs: ``stack_dump`` (:data:`STACK_METHODS`), the stacks of the hung ranks written
    to ``<job dir>/stacks/`` when ``failover.hang_timeout_s`` blames a hang.
    """

    skip_node_check: bool = False
    slow_factor: float = spec_field(2.0, gt=1)
    matmul_size: int = spec_field(256, ge=1)
    matmul_batch: int = spec_field(1, ge=1)
    matmul_iters: int = spec_field(20, ge=1)
    allgather_kb: int = spec_field(1024, ge=1, unit="KiB per rank")
    allgather_iters: int = spec_field(5, ge=1)
    warmup_iters: int = spec_field(1, ge=1)
    gpu_matmul_size: int = spec_field(2048, ge=1)
    gpu_matmul_batch: int = spec_field(10, ge=1)
    gpu_matmul_iters: int = spec_field(200, ge=1)
    gpu_allgather_mb: int = spec_field(64, ge=1, unit="MiB per rank")
    gpu_allgather_iters: int = spec_field(40, ge=1)
    gpu_warmup_iters: int = spec_field(20, ge=1)
    check_timeout_s: float = spec_field(10.0, gt=0, unit="seconds")
    straggler_action: str = spec_field("report", choices=STRAGGLER_ACTIONS)
    straggler_factor: float = spec_field(2.0, gt=1)
    straggler_windows: int = spec_field(3, ge=1)
    straggler_window_s: float = spec_field(5.0, gt=0, unit="seconds")
    stack_dump: str = spec_field("auto", choices=STACK_METHODS)


def validate_node_health(spec: DictConfig) -> None:
    """Check the rule of ``node_health.straggler_action: shrink`` (the fields' own
    checks run with the rest of the spec's: :func:`dlrover_core.spec.validate.validate`).

    Raises:
        SpecError: ``straggler_action: shrink`` on a role with a process group and more
            than one rank that has no node range ``roles.R.nodes`` with ``MIN < MAX``.
    """
    if spec.node_health.straggler_action == "shrink":
        _check_shrink(spec)


def _check_shrink(spec: DictConfig) -> None:
    """``straggler_action: shrink`` needs every role with a process group (``backend``)
    that can have a straggler (more than one rank, or a node range) to be elastic with
    room to shrink: ``roles.R.nodes`` ``"MIN:MAX"`` with ``MIN < MAX``; and at least one
    such role.

    Raises:
        SpecError: keyed ``node_health.straggler_action``, naming the role.
    """
    allowed = ("off, report or replace; shrink only when every role with a process group "
               "(backend) and more than one rank is elastic with room to shrink "
               "(roles.R.nodes \"MIN:MAX\" with MIN < MAX)")
    elastic = []
    for role, r in spec.roles.items():
        if not r.get("backend"):
            continue
        value = r.get("nodes")
        if value is None:
            if int(r.total) <= 1:
                continue  # one fixed rank: never compared, never a straggler
            raise SpecError("node_health.straggler_action", "shrink", allowed,
                            f"roles.{role} has {r.total} ranks and no node range "
                            f"(roles.{role}.nodes)")
        lo, hi = parse_nodes(value, f"roles.{role}.nodes")
        if lo >= hi:
            raise SpecError("node_health.straggler_action", "shrink", allowed,
                            f"roles.{role}.nodes is {value!r}: MIN = MAX, nothing to "
                            "shrink to")
        elastic.append(role)
    if not elastic:
        raise SpecError("node_health.straggler_action", "shrink", allowed,
                        "no role with a process group and a node range")
