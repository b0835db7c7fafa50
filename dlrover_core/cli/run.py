"""``dlrover-run``: torchrun's command line, run as a dlrover job.

    dlrover-run [torchrun's options] train.py [script args]
    dlrover-run [torchrun's options] -m pkg.train [script args]

The options are parsed by torch's own ``torch.distributed.run.get_args_parser()``, so
every torchrun flag is accepted; the job is one script role ``trainer`` (see
:mod:`dlrover_core.runtime.script`) of ``--nnodes`` x ``--nproc-per-node`` ranks, run on
the Ray cluster (an embedded one unless ``--address`` is given).

What each torchrun option does here:

- honoured: ``--nnodes N`` (or ``N:N``), ``--nnodes MIN:MAX`` (an elastic role,
  ``roles.trainer.nodes: "MIN:MAX"``, started at MAX nodes; see below),
  ``--nproc-per-node`` (an integer, ``cpu``, ``gpu``, ``auto``), ``--max-restarts``
  (``failover.max_restarts``), ``--rdzv-id`` (the job name and ``TORCHELASTIC_RUN_ID``),
  ``-m``/``--module``, ``--role`` (the role name, ``trainer`` when not given).
- accepted, nothing to do: ``--standalone``, ``--rdzv-backend static|c10d`` (the
  master makes the rendezvous: rank 0's node, a free port), ``--monitor-interval``
  (the master watches the ranks itself), ``--start-method spawn`` (each rank is a new
  ``python`` process).
- any other option set to something other than its default (``--no-python``,
  ``--master-port``, ``--log-dir``, ``--tee``, ``--node-rank`` ...) is refused before
  anything starts, with an error naming it.

``--nnodes MIN:MAX`` makes the role elastic (docs/elastic.md): it starts at ``MAX`` nodes
of ``--nproc-per-node`` ranks (all placed before the scripts start: the cluster needs room
for them), and when a node is lost it restarts at the largest size the nodes left
hold, down to ``MIN`` nodes (``WORLD_SIZE`` of the restarted scripts is the new size,
``TORCHELASTIC_RESTART_COUNT`` + 1). It grows back only after rank 0 reports a
checkpoint, which a plain script does not, so a script role does not grow.

dlrover-run's own options: ``--address`` (a Ray cluster to join), ``--job-dir``
(default ``runs/<job name>``), ``--cpus-per-rank`` (CPUs each rank reserves; default
``min(1, CPUs of this machine / ranks per node)``) and ``--quiet`` (the ranks' output
only in the job's log files, ``dlrover logs``, not on the console).

Exit code: the job's, through the table ``dlrover submit`` uses
(:data:`dlrover_core.spec.builder.EXIT_CODES`): 0 when the job succeeded (every rank's
script exited 0), 1 when it failed or was stopped (as torchrun, which exits 1 when a
worker fails); 2 for bad input and 3 when another run holds the job directory or the
checkpoint folder (nothing started in either case). (``submit``'s 4, already complete,
needs ``config.max_steps``, which a dlrover-run job has not.)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import uuid
from typing import Any, Sequence

#: torchrun options dlrover-run acts on (by ``dest``).
HONOURED = {"nnodes", "nproc_per_node", "max_restarts", "rdzv_id", "module",
            "role", "training_script", "training_script_args"}
#: options with nothing to do here, and the values that are fine (``None``: any).
ACCEPTED: dict[str, tuple | None] = {
    "standalone": None, "monitor_interval": None,
    "rdzv_backend": ("static", "c10d"), "start_method": ("spawn",),
}
#: why an option cannot be honoured (the error's reason), by ``dest``; others get a
#: generic reason.
WHY = {
    "no_python": "each rank runs the script with this Python",
    "run_path": "the script runs as a file or a module (-m)",
    "master_addr": "the rendezvous address is chosen by dlrover (rank 0's node)",
    "master_port": "the rendezvous port is chosen by dlrover (a free port on rank 0's node)",
    "node_rank": "one dlrover-run starts every node's ranks; node ranks are assigned",
    "rdzv_endpoint": "the rendezvous is made by dlrover's JobMaster",
    "log_dir": "the ranks' output goes to <job_dir>/logs (use --job-dir)",
    "tee": "the ranks' output goes to <job_dir>/logs and the console (use --quiet)",
    "redirects": "the ranks' output goes to <job_dir>/logs and the console (use --quiet)",
}


class UsageError(ValueError):
    """Bad command line (exit code 2)."""


def build_parser() -> argparse.ArgumentParser:
    """torch's torchrun parser plus dlrover-run's own options."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "dlrover-run"
    parser.description = ("torchrun's command line, run as a dlrover job on Ray "
                          "(see `dlrover_core/cli/run.py` for what each option does)")
    own = parser.add_argument_group("dlrover-run")
    own.add_argument("--address", default=None,
                     help="Ray cluster to join ('auto' or HOST:PORT); default: start one")
    own.add_argument("--job-dir", default=None, help="job directory (default runs/<name>)")
    own.add_argument("--cpus-per-rank", type=float, default=None,
                     help="CPUs each rank reserves (default: min(1, CPUs / ranks per node))")
    own.add_argument("--quiet", action="store_true",
                     help="the ranks' output only in the log files (`dlrover logs`)")
    return parser


def _flag(parser: argparse.ArgumentParser, dest: str) -> str:
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return dest


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Raise :class:`UsageError` naming the first torchrun option set to something
    dlrover-run cannot honour."""
    own = {"address", "job_dir", "cpus_per_rank", "quiet", "help"}
    for action in parser._actions:
        dest = action.dest
        if dest in HONOURED or dest in own:
            continue
        value = getattr(args, dest, None)
        if dest in ACCEPTED:
            allowed = ACCEPTED[dest]
            if allowed is None or value in allowed:
                continue
            raise UsageError(f"dlrover-run cannot honour {_flag(parser, dest)}={value!r}; "
                             f"allowed: {', '.join(map(str, allowed))}")
        if value == action.default:
            continue
        why = WHY.get(dest, "dlrover-run does not implement it")
        raise UsageError(f"dlrover-run cannot honour {_flag(parser, dest)}={value!r}: {why}")


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


def local_world_size(value: str) -> int:
    """``--nproc-per-node``: an integer, or ``cpu``/``gpu``/``auto`` (torch's own
    ``determine_local_world_size``). Raises :class:`UsageError`."""
    from torch.distributed.run import determine_local_world_size

    try:
        n = determine_local_world_size(str(value))
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"--nproc-per-node={value!r}: {exc}") from None
    if n < 1:
        raise UsageError(f"--nproc-per-node={value!r}: allowed: an integer >= 1, cpu, gpu, auto")
    return n


_NAME_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def job_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The job spec (a plain dict, validated by ``load_spec``) for parsed ``args``."""
    import shlex

    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    nproc = local_world_size(args.nproc_per_node)
    if args.training_script is None:
        raise UsageError("no training script given: dlrover-run [options] train.py [args]")
    words = (["-m"] if args.module else []) + [args.training_script] + \
        list(args.training_script_args or [])
    run_id = args.rdzv_id if args.rdzv_id not in (None, "none") else None
    if run_id is None:
        base = os.path.splitext(os.path.basename(args.training_script))[0]
        base = _NAME_BAD.sub("-", base).strip("-._") or "script"
        name = f"{base}-{uuid.uuid4().hex[:6]}"
    else:
        name = run_id
    cpus = args.cpus_per_rank
    if cpus is None:
        cpus = min(1.0, (os.cpu_count() or 1) / nproc)
    role = "trainer" if args.role == "default" else args.role
    spec_role: dict[str, Any] = {"command": shlex.join(words), "total": max_nodes * nproc,
                                 "per_node": nproc, "resources": {"cpu": round(cpus, 3)}}
    if min_nodes != max_nodes:  # elastic: starts at MAX nodes, shrinks down to MIN
        spec_role["nodes"] = f"{min_nodes}:{max_nodes}"
    return {
        "name": name,
        "roles": {role: spec_role},
        "failover": {"max_restarts": int(args.max_restarts)},
    }


def main(argv: Sequence[str] | None = None) -> int:
    from dlrover_core.cli.output import console_for
    from dlrover_core.spec.errors import SpecError

    err = console_for(stderr=True)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_options(parser, args)
        spec_dict = job_spec(args)
        from dlrover_core.spec.loader import load_spec

        spec = load_spec(spec_dict)
    except (UsageError, SpecError) as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    from dlrover_core.cli.progress import print_summary
    from dlrover_core.master.client import submit_job
    from dlrover_core.master.dir_lock import DirInUseError
    from dlrover_core.spec.builder import EXIT_CODES  # the table of `dlrover submit`

    job_dir = os.path.abspath(args.job_dir or os.path.join("runs", spec.name))
    try:
        summary = submit_job(spec, address=args.address, job_dir=job_dir, progress=False,
                             verbose=not args.quiet)
    except DirInUseError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 3
    if summary is None:
        err.print("the job ended without a summary")
        return 1
    print_summary(summary)
    err.print(f"job directory: {job_dir}  (logs: dlrover logs {spec.name} --job-dir {job_dir})")
    return EXIT_CODES.get(summary.get("status"), 1)


if __name__ == "__main__":
    sys.exit(main())
