"""``dlrover-run``'s command line (:mod:`dlrover_core.cli.run`): torch's own torchrun
parser with dlrover-run's flags (:func:`build_parser`), the check of every option before
anything starts (:func:`check_options`, :func:`meeting_place`, :func:`dlrover_flags`),
the counts of nodes and ranks per node (:func:`parse_nnodes`, :func:`local_world_size`,
GPUs counted on the cluster's nodes), the default job name (:func:`default_job_name`)
and the job spec of the one script role (:func:`job_spec`). Bad input raises
:class:`UsageError` (exit code 2)."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import socket
from typing import Any

#: torchrun options dlrover-run acts on (by ``dest``); the meeting-place options
#: (``node_rank``, ``rdzv_endpoint``, ``master_addr``, ``master_port``, ``rdzv_conf``)
#: are checked by :func:`meeting_place`.
HONOURED = {"nnodes", "nproc_per_node", "max_restarts", "rdzv_id", "module",
            "role", "training_script", "training_script_args", "signals_to_handle",
            "shutdown_timeout", "node_rank", "rdzv_endpoint", "master_addr",
            "master_port", "rdzv_conf"}
#: options with nothing to do here, and the values that are fine (``None``: any).
ACCEPTED: dict[str, tuple | None] = {
    "standalone": None, "monitor_interval": None, "local_addr": None,
    "rdzv_backend": ("static", "c10d"), "start_method": ("spawn",),
}
#: why an option cannot be honoured (the error's reason), by ``dest``; others get a
#: generic reason.
WHY = {
    "no_python": "each rank runs the script with this Python",
    "run_path": "the script runs as a file or a module (-m)",
    "log_dir": "the ranks' output goes to <job_dir>/logs (use --job-dir)",
    "tee": "the ranks' output goes to <job_dir>/logs and the console (use --quiet)",
    "redirects": "the ranks' output goes to <job_dir>/logs and the console (use --quiet)",
    "local_ranks_filter": "every rank's output goes to the console (use --quiet for none)",
    "numa_binding": "no NUMA binding here; bind inside the script "
                    "(os.sched_setaffinity) where it matters",
    "virtual_local_rank": "LOCAL_RANK is the rank on its node, as torchrun's default",
    "event_log_handler": "the job's events go to <job_dir>/events.jsonl",
    "logs_specs": "the ranks' output goes to <job_dir>/logs",
}
#: dlrover-run's own options (by ``dest``).
OWN = {"address", "job_dir", "cpus_per_rank", "quiet", "detach", "help"}
#: DLRover's ``dlrover-run`` flags (by ``dest``): each mapped below (:func:`dlrover_flags`).
DLROVER = {"network_check", "precheck", "comm_perf_test", "exclude_straggler",
           "save_at_breakpoint", "auto_config", "auto_tunning", "accelerator",
           "training_port", "node_unit", "numa_affinity"}
#: Ray's default head port, suggested (``--address HOST:6379``) when a multi-node line
#: names a meeting place ``HOST`` and no ``--address`` is given
RAY_HEAD_PORT = 6379


class UsageError(ValueError):
    """Bad command line (exit code 2)."""



def build_parser() -> argparse.ArgumentParser:
    """torch's torchrun parser plus dlrover-run's own options and DLRover's flags."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "dlrover-run"
    parser.description = ("torchrun's command line, run as a dlrover job on Ray "
                          "(docs/torchrun.md says what each option does here)")
    own = parser.add_argument_group("dlrover-run")
    own.add_argument("--address", default=None,
                     help="Ray cluster to join ('auto' or HOST:PORT); default: start one")
    own.add_argument("--job-dir", default=None, help="job directory (default runs/<name>)")
    own.add_argument("--cpus-per-rank", type=float, default=None,
                     help="CPUs each rank reserves (default: min(1, CPUs / ranks per node))")
    own.add_argument("--quiet", action="store_true",
                     help="the ranks' output only in the log files (`dlrover logs`)")
    own.add_argument("--detach", action="store_true",
                     help="with --address: Ctrl-C leaves the job running (default: "
                          "SIGINT is forwarded to the ranks, as every handled signal)")
    dl = parser.add_argument_group("DLRover's dlrover-run flags (docs/torchrun.md)")
    dl.add_argument("--network-check", "--network_check", action="store_true",
                    help="node check before the ranks start (on by default here)")
    dl.add_argument("--precheck", type=int, default=0, choices=(0, 1, 2),
                    help="1, 2: the node check (0: the default here, node check on)")
    dl.add_argument("--comm-perf-test", "--comm_perf_test", action="store_true",
                    help="the node check (its paired all-gather measures the links)")
    dl.add_argument("--exclude-straggler", "--exclude_straggler", action="store_true",
                    help="the node check excludes a slow node (node_health.slow_factor)")
    dl.add_argument("--save-at-breakpoint", "--save_at_breakpoint", action="store_true",
                    help="flash checkpoints are persisted after a failure (always, "
                         "with dlrover_plugin_flashckpt)")
    dl.add_argument("--auto-config", "--auto_config", action="store_true",
                    help="refused: give --nnodes and --nproc-per-node gpu|auto")
    dl.add_argument("--auto-tunning", "--auto_tunning", action="store_true",
                    help="refused: the tuner needs a BaseWorkload (docs/tuning.md)")
    dl.add_argument("--accelerator", default=None,
                    help="nvidia.com/gpu: one GPU per rank; other values are refused")
    dl.add_argument("--training-port", "--training_port", type=int, default=None,
                    help="refused: the rendezvous port is chosen by dlrover")
    dl.add_argument("--node-unit", "--node_unit", type=int, default=1,
                    help="node groups of this size: --nnodes must be a multiple of it")
    dl.add_argument("--numa-affinity", "--numa_affinity", action="store_true",
                    help="refused: no NUMA binding here")
    return parser


def _flag(parser: argparse.ArgumentParser, dest: str) -> str:
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=lambda o: (o.count("-"), len(o)))
    return dest


def _given(parser: argparse.ArgumentParser, dest: str, value: Any) -> str:
    """``--flag=value``, with where it came from when that is torchrun's ``PET_<DEST>``
    environment variable (Kubeflow's PyTorchJob sets them) rather than the line."""
    env = "PET_" + dest.upper()
    text = f"{_flag(parser, dest)}={value!r}"
    if env in os.environ and str(os.environ[env]) == str(value):
        text += f" (from the environment variable {env})"
    return text


def _defaults() -> dict[str, Any]:
    """torchrun's defaults by ``dest``, without the ``PET_*`` variables (torch's parser
    takes its defaults from them when it is built)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PET_")}
    try:
        return {a.dest: a.default for a in build_parser()._actions}
    finally:
        os.environ.update(saved)


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` naming the first torchrun option set to something
    dlrover-run cannot honour (given on the line or through its ``PET_*`` variable)."""
    defaults = _defaults()
    for action in parser._actions:
        dest = action.dest
        if dest in HONOURED or dest in OWN or dest in DLROVER:
            continue
        value = getattr(args, dest, None)
        default = defaults.get(dest, action.default)
        if dest in ACCEPTED:
            allowed = ACCEPTED[dest]
            if allowed is None or value in allowed:
                continue
            raise UsageError(f"dlrover-run cannot honour {_given(parser, dest, value)}; "
                             f"allowed: {', '.join(map(str, allowed))}")
        if value == default or str(value) == str(default):
            continue
        why = WHY.get(dest, "dlrover-run does not implement it")
        raise UsageError(f"dlrover-run cannot honour {_given(parser, dest, value)}: {why}")


def _is_local(host: str) -> bool:
    return host in ("", "127.0.0.1", "localhost", "::1", "0.0.0.0") or \
        host in (socket.gethostname(), socket.getfqdn())


def meeting_place(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The host a torchrun line written for several nodes names as the place to meet
    (``--rdzv-endpoint HOST[:PORT]``, else ``--master-addr HOST``, or their ``PET_*``
    variables), ``None`` when it names this machine or ``--standalone`` is given (torchrun
    ignores both then). dlrover-run reads it as where the Ray head is; the ranks meet where dlrover's master says (rank 0's node,
    a free port), so ``--master-port`` and ``--rdzv-conf`` have nothing to do.
    :func:`main` refuses a meeting place without ``--address`` or ``RAY_ADDRESS``.

    Raises:
        UsageError: ``--node-rank`` other than 0 (the line is run once, not per node).
    """
    if str(args.node_rank) != "0":
        raise UsageError(
            f"dlrover-run cannot honour {_given(parser, 'node_rank', args.node_rank)}: one "
            "dlrover-run starts the ranks of every node; run this line once, on one "
            "machine (node rank 0), with --address HOST:PORT of the Ray cluster (or from "
            "within it), and on the other machines `ray start --address HOST:PORT` instead")
    if args.standalone:
        return None
    endpoint = str(args.rdzv_endpoint or "").strip()
    if endpoint:
        host = endpoint.rsplit(":", 1)[0] if endpoint.count(":") == 1 or \
            endpoint.startswith("[") else endpoint
        host = host.strip("[]")
    else:
        host = str(args.master_addr or "").strip()
    return None if _is_local(host) else host


def dlrover_flags(args: argparse.Namespace, min_nodes: int, max_nodes: int) -> dict[str, Any]:
    """What DLRover's ``dlrover-run`` flags set in the job spec (a dict of top-level
    sections to merge), or :class:`UsageError` naming the flag, its value and the
    nearest equivalent here."""
    out: dict[str, Any] = {}
    if args.network_check or args.comm_perf_test or args.precheck or args.exclude_straggler:
        out["node_health"] = {"skip_node_check": False}
    if args.auto_config:
        raise UsageError("dlrover-run cannot honour --auto-config: give --nnodes N and "
                         "--nproc-per-node gpu|auto (counted on the cluster's nodes)")
    if args.auto_tunning:
        raise UsageError("dlrover-run cannot honour --auto-tunning: the tuner changes a "
                         "BaseWorkload's settings between steps (tuning.enabled in a job "
                         "spec, docs/tuning.md); a script role has no such hook")
    if args.accelerator not in (None, "nvidia.com/gpu"):
        raise UsageError(f"dlrover-run cannot honour --accelerator={args.accelerator!r}; "
                         "allowed: nvidia.com/gpu (or leave it out: CPUs)")
    if args.training_port is not None:
        raise UsageError(f"dlrover-run cannot honour --training-port={args.training_port!r}: "
                         "the rendezvous port is chosen by dlrover (a free port on rank "
                         "0's node)")
    if args.numa_affinity:
        raise UsageError("dlrover-run cannot honour --numa-affinity: no NUMA binding here; "
                         "bind inside the script (os.sched_setaffinity) where it matters")
    unit = int(args.node_unit)
    if unit < 1 or (unit > 1 and (min_nodes != max_nodes or max_nodes % unit)):
        raise UsageError(f"dlrover-run cannot honour --node-unit={unit!r}: allowed: 1, or a "
                         "divisor of a fixed --nnodes N (an elastic role grows and shrinks "
                         "one node at a time)")
    return out


def parse_nnodes(value: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``"2"`` or ``"2:2"`` -> ``(2, 2)``; ``"1:4"`` -> ``(1, 4)``
    (an elastic node range).

    Raises:
        UsageError: not ``N`` or ``MIN:MAX`` of integers with ``1 <= MIN <= MAX``.
    """
    lo, sep, hi = str(value).partition(":")
    allowed = "N or MIN:MAX with 1 <= MIN <= MAX (integers)"
    try:
        n, m = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UsageError(f"--nnodes={value!r}: allowed: {allowed}") from None
    if n < 1 or n > m:
        raise UsageError(f"--nnodes={value!r}: allowed: {allowed}")
    return n, m


def cluster_devices() -> list[dict[str, float]]:
    """``{"CPU": n, "GPU": n}`` of each alive node of the Ray cluster this process is
    connected to."""
    import ray

    return [{"CPU": float(n["Resources"].get("CPU", 0)),
             "GPU": float(n["Resources"].get("GPU", 0))}
            for n in ray.nodes() if n.get("Alive")]


def local_world_size(value: str, nodes: list[dict[str, float]] | None = None) -> int:
    """``--nproc-per-node``: an integer, or ``cpu``/``gpu``/``auto`` counted as torch's
    ``determine_local_world_size`` counts them, on the cluster's nodes when ``nodes``
    (:func:`cluster_devices`) is given: the smallest count of a node that has any (so
    every node group fits on one node), else on this machine.

    Raises:
        UsageError: not one of these, or ``gpu`` where no node has a GPU.
    """
    from torch.distributed.run import determine_local_world_size

    value = str(value)
    if nodes is not None and value in ("cpu", "gpu", "auto"):
        gpus = [int(n["GPU"]) for n in nodes if n["GPU"] >= 1]
        cpus = [int(n["CPU"]) for n in nodes if n["CPU"] >= 1]
        if value == "gpu" and not gpus:
            raise UsageError(f"--nproc-per-node={value!r}: no node of the Ray cluster has "
                             "a GPU; allowed there: an integer >= 1, cpu, auto")
        counts = gpus if value in ("gpu", "auto") and gpus else cpus
        if counts:
            return min(counts)
    try:
        n = determine_local_world_size(value)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"--nproc-per-node={value!r}: {exc}") from None
    if n < 1:
        raise UsageError(f"--nproc-per-node={value!r}: allowed: an integer >= 1, cpu, gpu, auto")
    return n


def wants_gpus(args: argparse.Namespace, nodes: list[dict[str, float]] | None) -> bool:
    """Whether each rank reserves one GPU: ``--accelerator nvidia.com/gpu``,
    ``--nproc-per-node gpu``, or ``auto`` on a cluster with GPUs."""
    value = str(args.nproc_per_node)
    has_gpu = any(n["GPU"] >= 1 for n in (nodes or []))
    return args.accelerator == "nvidia.com/gpu" or value == "gpu" or \
        (value == "auto" and has_gpu)


_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def default_job_name(args: argparse.Namespace) -> str:
    """The job's name when ``--rdzv-id`` is not given: the script's file name without
    ``.py`` (``-m pkg.mod``: ``pkg.mod``) and 6 hex digits of a hash of where it is (the
    script's absolute path; for a module, the module name and the current directory).
    The same script gets the same name at every submit, so a resubmit is the same
    job (its job directory ``runs/<name>``, its checkpoints); two scripts of the same
    file name in different folders get different ones."""
    target = str(args.training_script)
    if args.module:
        stem, where = target, f"module:{target}:{os.getcwd()}"
    else:
        stem = os.path.basename(target)
        stem = stem[:-3] if stem.endswith(".py") else stem
        where = f"script:{os.path.abspath(target)}"
    base = _NAME_BAD.sub("-", stem).strip("-._") or "script"
    return f"{base}-{hashlib.sha1(where.encode()).hexdigest()[:6]}"


def job_spec(args: argparse.Namespace, nodes: list[dict[str, float]] | None = None) \
        -> dict[str, Any]:
    """The job spec (a plain dict, validated by ``load_spec``) for parsed ``args``;
    ``nodes``: the cluster's nodes (:func:`cluster_devices`) for ``--nproc-per-node
    gpu|auto`` and ``--accelerator``.

    Raises:
        UsageError: a value dlrover-run cannot run (names the option, the value and
            what is allowed).
    """
    import shlex

    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    nproc = local_world_size(args.nproc_per_node, nodes)
    if args.training_script is None:
        raise UsageError("no training script given: dlrover-run [options] train.py [args]")
    extra = dlrover_flags(args, min_nodes, max_nodes)
    words = (["-m"] if args.module else []) + [args.training_script] + \
        list(args.training_script_args or [])
    run_id = args.rdzv_id if args.rdzv_id not in (None, "none") else None
    name = default_job_name(args) if run_id is None else run_id
    cpus = args.cpus_per_rank
    if cpus is None:
        cpus = min(1.0, (os.cpu_count() or 1) / nproc)
    role = "trainer" if args.role == "default" else args.role
    gpu = wants_gpus(args, nodes)
    # the environment torchrun gives that a Ray actor's would not: torchrun's role
    # name, and OMP_NUM_THREADS as torchrun sets it (Ray sets it to the actor's CPUs)
    env = {"DLROVER_TORCHRUN_ROLE": str(args.role)}
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    elif nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    for key in ("PYTHONBREAKPOINT",):
        if key in os.environ:
            env[key] = os.environ[key]
    # torchrun's workers inherit its niceness (the shell's, 0 as a rule); Ray starts its
    # workers at niceness 15 unless the actor's runtime env says otherwise, and a rank at
    # 15 yields its core to every Ray daemon and to any other process: 0.91x torchrun's
    # steady steps/s on 2 cores (issue 51). RAY_worker_niceness: read by the raylet when
    # it starts the actor's worker process (Ray's job supervisor sets it the same way).
    env["RAY_worker_niceness"] = os.environ.get("RAY_worker_niceness",
                                                str(os.getpriority(os.PRIO_PROCESS, 0)))
    spec_role: dict[str, Any] = {"command": shlex.join(words), "total": max_nodes * nproc,
                                 "per_node": nproc,
                                 "resources": {"cpu": round(cpus, 3), "gpu": 1.0 if gpu else 0.0},
                                 "env": env}
    spec: dict[str, Any] = {"name": name, "roles": {role: spec_role},
                            "failover": {"max_restarts": int(args.max_restarts)}, **extra}
    if min_nodes != max_nodes:  # elastic: starts at MAX nodes, shrinks down to MIN
        spec_role["nodes"] = f"{min_nodes}:{max_nodes}"
    elif gpu and max_nodes > 1:  # node groups on distinct nodes (set_device(LOCAL_RANK))
        del spec_role["per_node"]
        spec["node_num"] = max_nodes
    return spec
