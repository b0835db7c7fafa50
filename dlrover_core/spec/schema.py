"""The job spec schema (OmegaConf structured config).

One schema, three ways in: a YAML file with ``key=value`` dot-list overrides
(:func:`dlrover_core.spec.loader.load_spec`), the fluent
:class:`dlrover_core.spec.builder.DLJobBuilder`, or a graph template that fills in
roles, edges and the driver. Example::

    name: nanogpt
    template: sft
    roles:
      trainer: {workload: examples.nanogpt.workload:GPTWorkload, total: 2, per_node: 2,
                backend: fsdp, resources: {cpu: 1, gpu: 0}}
    checkpoint: {saver: disk, every_steps: 50, keep: 3}
    config: {max_steps: 300}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from dlrover_core.observability.log_limits import (DEFAULT_LOG_BACKUPS, DEFAULT_LOG_MAX_BYTES,
                                                   MIN_LOG_BYTES)
from dlrover_core.spec.fields import spec_field
from dlrover_core.spec.node_health import NodeHealthSpec


@dataclass
class ResourceSpec:
    """Resources of one role instance: ``cpu`` and ``gpu`` (units, fractions allowed),
    ``memory_mb`` (MiB, 0 = no reservation). ``gpu`` left unset is 1 when the job
    sets ``device_per_node`` (one device per instance, as seed ``004``'s builder
    implies), else 0; collocated roles share their bundle's GPUs (each actor asks
    for ``1/len(roles)`` of it)."""

    cpu: float = spec_field(1.0, ge=0)
    gpu: Optional[float] = spec_field(None, ge=0)
    memory_mb: int = 0


@dataclass
class RoleSpec:
    """One role: ``total`` instances, ``per_node`` of them on each node.

    ``workload`` is the import path ``package.module:Class`` of a ``BaseWorkload``
    subclass; ``backend`` names an SPMD backend (``ddp``, ``fsdp``) or is empty for
    roles without a process group; ``config`` is merged over the job's ``config``
    for this role only.

    ``command`` makes it a *script role* instead (no ``workload``): an unchanged
    torchrun script, ``"train.py --epochs 3"``, ``"-m pkg.train args"`` or
    ``"pkg.train:main args"``, run by each rank as a child process with torchrun's
    environment (see :mod:`dlrover_core.runtime.script`); ``working_dir`` is its
    working directory (default: the directory the spec was loaded from, i.e. the
    current directory, as with torchrun).
    """

    workload: str = MISSING
    total: int = spec_field(1, ge=1)
    #: 0: all instances on one node (per_node = total)
    per_node: int = spec_field(0, ge=0, allowed="an integer >= 1 (or 0 for total)")
    backend: Optional[str] = None
    resources: ResourceSpec = field(default_factory=ResourceSpec)
    env: Dict[str, str] = field(default_factory=dict)
    config: Dict[str, Any] = field(default_factory=dict)
    #: elastic node count: "MIN:MAX" (torchrun's --nnodes; quote it in YAML), "N", N or
    #: {min, max}; None: the role is fixed at ``total`` (see docs/elastic.md)
    nodes: Any = None
    #: off (default): every GPU of the node is visible to the role's instances and each
    #: uses the GPU Ray reserved for it (``cuda:<Ray's id>``); on: Ray sets
    #: ``CUDA_VISIBLE_DEVICES`` to that GPU and the instance uses ``cuda:0``.
    enable_ray_auto_visible_device: bool = False
    command: Optional[str] = None
    working_dir: Optional[str] = None


@dataclass
class FailoverSpec:
    """Failure handling budgets and timeouts.

    ``max_restarts``: restarts of the job's actors allowed in all (process, role and
    job level together) before the job fails. ``max_node_failures``: failures on one
    node before it is marked bad. ``hang_timeout_s``: seconds without a step report
    from a running role before it counts as hung (0 disables). ``call_hang_min_s``: in
    a job with a driver and ``hang_timeout_s`` 0, a role call counts as hung once it has
    run for max(``call_hang_min_s``, 10 x the p99 of the last 64 durations of that
    method on that rank), after 5 of them (0 turns this default off). ``pg_timeout_s``:
    torch.distributed collective timeout in s. ``in_place``: on a ``process``-level
    failure in a role with a process group, keep the surviving ranks' processes and
    re-form the group in them (False: restart every rank of the role).
    ``survivor_grace_s``: how long survivors get to leave their failed collective
    before they are replaced too. ``standby``: keep one warm spare process per role with
    a process group (imports done, ``warm_up()`` run) to replace a failed rank without a
    process start; the spare holds a reservation like a rank's, a placement-group bundle
    with one rank's resources (CPU, GPU, memory), so the cluster needs room for one more
    rank per role (:mod:`dlrover_core.master.standby`; without room it waits, not warm).
    ``master_max_restarts``: how many times Ray restarts the JobMaster's actor after its
    process died, over the job's life (Ray's ``max_restarts`` of that actor; each
    restart re-attaches to the running job). One more death ends the job's control: a
    long job that must survive more master failures sets it higher.
    """

    max_restarts: int = spec_field(3, ge=0)
    master_max_restarts: int = spec_field(3, ge=0)
    max_node_failures: int = 2
    hang_timeout_s: float = spec_field(0.0, ge=0, unit="seconds", note="0 = off")
    call_hang_min_s: float = spec_field(
        60.0, ge=0, unit="seconds", note="0 = no default hang bound for driver calls")
    pg_timeout_s: float = spec_field(120.0, gt=0, unit="seconds")
    in_place: bool = True
    survivor_grace_s: float = 10.0
    standby: bool = True


@dataclass
class ElasticSpec:
    """Elastic roles (``roles.R.nodes`` ranges; docs/elastic.md).
    ``replacement_timeout_s``: after a node of an elastic role is lost, how long to wait
    for the cluster to hold the role at its size again before shrinking it.
    ``poll_interval_s``: how often the master looks for room to grow an elastic role
    below its maximum (it grows at the next checkpoint after room appeared).
    ``placement_timeout_s``: how long a resize waits for the placement groups of a new
    size (reserved before any rank stops) before it tries the next smaller size (a
    shrink) or drops the grow.
    ``global_batch`` / ``micro_batch``: when set, a world size is valid only if it splits
    ``global_batch`` into micro-batches (gradient accumulation keeps the global batch)."""

    replacement_timeout_s: float = spec_field(60.0, ge=0, unit="seconds",
                                              note="0: shrink at once")
    poll_interval_s: float = spec_field(5.0, gt=0, unit="seconds")
    placement_timeout_s: float = spec_field(30.0, gt=0, unit="seconds")
    global_batch: int = 0
    micro_batch: int = 0


@dataclass
class CheckpointSpec:
    """``saver``: a registered saver name (``disk``, ``flash``); ``dir``: where
    committed steps go (default ``<job dir>/ckpt``); ``every_steps``: save interval
    in steps (0: only when the workload asks); ``keep``: committed steps kept;
    ``options``: saver-specific settings (see the saver plugin's README)."""

    saver: str = "disk"
    dir: Optional[str] = None
    every_steps: int = spec_field(0, ge=0)
    keep: int = spec_field(3, ge=1)
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TuningGuardSpec:
    """The guard that keeps a change only when it earned its gain (see
    ``dlrover_core/tuning/guard.py``): ``windows``: windows of ``interval_steps`` steps
    measured per configuration (>= 2); ``confidence``: the confidence of the one-sided
    Welch's t-test on the window rates that the change is faster; ``min_gain``: the
    relative gain it must show (0: any); ``max_retries``: how often a reverted change
    may be tried again, ``retry_shift``: once the baseline's samples/s moved by more
    than this (relative) or its data-wait share by more than this (absolute);
    ``memory_limit_bytes``: per-rank memory limit in bytes (0: the capacity the ranks
    report); ``memory_headroom``: fraction of that capacity kept free; ``max_windows``:
    a trial that shows a gain short of the confidence is measured on up to this many
    windows and judged again (0: judged once); ``select_by_mean``: a trial still undecided
    at that second look is kept when its mean rate beats the baseline's by ``min_gain``
    (the faster one is selected; needs ``max_windows``)."""

    windows: int = spec_field(3, ge=2, note="the t-test needs two windows")
    max_windows: int = spec_field(
        0, valid=lambda v, g: v == 0 or v > g.windows,
        allowed=lambda g: f"0 (one look) or an integer > tuning.guard.windows ({g.windows})")
    select_by_mean: bool = spec_field(
        False, valid=lambda v, g: not v or g.max_windows > 0,
        allowed="false, or true with tuning.guard.max_windows set (the second look selects)")
    confidence: float = spec_field(0.9, ge=0.5, lt=1)
    min_gain: float = spec_field(0.0, ge=0, lt=10)
    max_retries: int = spec_field(1, ge=0)
    retry_shift: float = spec_field(0.25, gt=0)
    memory_limit_bytes: int = spec_field(0, ge=0, unit="bytes",
                                         note="0: the capacity the ranks report")
    memory_headroom: float = spec_field(0.1, ge=0, lt=1, unit="a fraction")


@dataclass
class TuningSpec:
    """Online tuning (see docs/tuning.md). ``tuners``: registered tuner names, in
    priority order; ``role``: the tuned role (default: the only role with a backend);
    every ``interval_steps`` steps the tuners see the window measured under the current
    config; ``warmup_steps``: steps skipped after a switch before measuring;
    ``lr_scaling``: ``linear``, ``sqrt`` or ``none`` when the global batch changes;
    ``one_change_per_round``: try one tuner's change per window, the tuners taking
    turns (false: merge every tuner's change into one version); ``options``: per tuner name, its options (e.g.
    ``{dataloader_workers: {max_num_workers: 4}}``)."""

    enabled: bool = False
    tuners: List[str] = field(default_factory=lambda: ["dataloader_workers", "micro_batch"])
    role: Optional[str] = None
    interval_steps: int = spec_field(20, ge=1)
    warmup_steps: int = spec_field(2, ge=0)
    lr_scaling: str = "linear"
    guard: TuningGuardSpec = field(default_factory=TuningGuardSpec)
    one_change_per_round: bool = True
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ObservabilitySpec:
    """What the job writes besides its job directory's own files (see
    ``dlrover_core/observability``). ``tensorboard``: ``false`` (default), ``true``
    (event files in ``<job_dir>/tensorboard``) or a directory (``<dir>/<job name>``,
    relative to the job directory's parent): every reported metric and the job's events
    (restarts, recovery and checkpoint time, goodput) as TensorBoard scalars, written by
    the JobMaster; needs torch and the ``tensorboard`` extra.

    Worker output (:mod:`dlrover_core.runtime.log_capture`): ``worker_logs`` (default
    ``true``) captures each role instance's and the driver's stdout/stderr into
    ``<job_dir>/logs/<role>-<rank>/attempt-<N>.log`` (``dlrover logs``); a file is
    rotated when it reaches ``log_max_bytes`` bytes (>= 1024; default 10 MiB), keeping
    ``log_backups`` older parts (>= 0; default 3)."""

    tensorboard: Any = False
    worker_logs: bool = True
    log_max_bytes: int = spec_field(DEFAULT_LOG_MAX_BYTES, ge=MIN_LOG_BYTES,
                                    unit="bytes per log file")
    log_backups: int = spec_field(DEFAULT_LOG_BACKUPS, ge=0, note="rotated parts kept; 0: none")


@dataclass
class JobSpec:
    """A whole job. ``edges`` are ``[src_role, dst_role]`` data-flow pairs;
    ``collocation`` lists groups of roles that share bundles (devices); ``driver``
    is the import path of a ``BaseTrainer`` subclass for MPMD jobs; ``env`` is the
    global environment (every role's processes and the driver), overridden by a role's
    ``env``. ``node_num``: the nodes the job spans; a role whose ``per_node`` is unset
    and whose ``total`` is a multiple of ``node_num`` gets ``total / node_num`` ranks on
    each of ``node_num`` distinct nodes. ``device_per_node``: devices of
    ``device_type`` (``GPU``, the default, or ``CPU``) on each node; with ``CPU`` an
    instance holds ``resources.cpu`` of them and no GPU."""

    name: str = MISSING
    template: Optional[str] = None
    dl_type: str = "SFT"
    node_num: int = 0
    device_per_node: int = 0
    device_type: str = "GPU"
    roles: Dict[str, RoleSpec] = field(default_factory=dict)
    edges: List[List[str]] = field(default_factory=list)
    driver: Optional[str] = None
    collocation: List[List[str]] = field(default_factory=list)
    placement: str = "pack"
    failover: FailoverSpec = field(default_factory=FailoverSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    elastic: ElasticSpec = field(default_factory=ElasticSpec)
    tuning: TuningSpec = field(default_factory=TuningSpec)
    observability: ObservabilitySpec = field(default_factory=ObservabilitySpec)
    node_health: NodeHealthSpec = field(default_factory=NodeHealthSpec)
    env: Dict[str, str] = field(default_factory=dict)
    config: Any = field(default_factory=dict)


#: ``dl_type`` values of the builder and the template each one selects by default.
DL_TYPES = {"PRE": "sft", "SFT": "sft", "RL": "ppo", "MULTIMODAL": "multimodal", "ODL": "odl"}
