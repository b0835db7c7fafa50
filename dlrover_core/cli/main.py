"""The ``dlrover`` command.

    dlrover plugins list [--json]
    dlrover plugin new NAME --kind KIND [--dir DIR] [--force]
    dlrover templates list [--json]
    dlrover validate JOB.yaml [key=value ...] [--working-dir DIR]
    dlrover submit JOB.yaml [key=value ...] [--address ADDR] [--job-dir DIR] [--fresh]
                   [--working-dir DIR] [--no-wait]
    dlrover status NAME [--address ADDR] [--job-dir DIR] [--run N] [--json]
    dlrover stop NAME [--address ADDR] [--job-dir DIR]
    dlrover delete NAME [--address ADDR] [--job-dir DIR]
    dlrover list [--root DIR] [--address ADDR] [--no-cluster] [--json]
    dlrover cluster up|add|env|status|down [--dir DIR]  (a `ray start` cluster here)
    dlrover logs JOB [--role R] [--rank K] [--attempt N] [-f] [--job-dir DIR] [--run N]
    dlrover timeline JOB [-o timeline.png] [--job-dir DIR] [--run N] [--json]
    dlrover diagnose JOB [--job-dir DIR] [--json]
    dlrover hooks [--json] [--write FILE]
    dlrover schema [-o FILE] [--no-plugins]  (the job spec's JSON Schema)

Each ``submit`` is a new run of the job in its job directory (``runs/NAME``): it
resumes from the job's checkpoints and says from which step, source and path;
``--fresh`` moves them aside (to ``<job_dir>/run-<N>/ckpt``) and starts over. ``status``,
``logs`` and ``timeline`` show the latest run, ``--run N`` another one.

``status``, ``stop``, ``logs`` and ``timeline`` find a job by one rule
(:func:`dlrover_core.cli.job_files.find_job`): ``--job-dir``, else a job directory's
path, else a name matching exactly one job directory under ``runs/`` (by directory or
job name) or (``status``, ``stop``) running job; several matches are an error that
lists them.

Exit codes: 0 success (``submit``: the job succeeded), 1 the job failed or was
stopped, 2 bad input (invalid spec, unknown name), 3 (``submit``) the job directory
or checkpoint folder is in use by another run, 4 (``submit``) nothing to train: the
checkpoint resumed from already reached ``config.max_steps`` (status
``already_complete``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from dlrover_core import __version__
from dlrover_core.cli import (cluster, diagnose, hooks_doc, jobs_list, logs, plugin_new,
                              timeline_cmd)
from dlrover_core.cli.job_files import run_option
from dlrover_core.cli.job_control import (  # noqa: F401 - status_line: re-exported
    cmd_delete, cmd_status, cmd_stop, status_line)
from dlrover_core.cli.output import err, print_json, print_table
from dlrover_core.spec.builder import EXIT_CODES  # one table for the CLI and DLJob.submit


def _pm():
    from dlrover_core.plugins.manager import get_plugin_manager

    return get_plugin_manager()


def provides_cell(info: dict) -> str:
    """What a plugin provides, for the table: the names it registers (``saver:flash``),
    then the other hooks it implements (``hook:classify_failure``), so a plugin that
    only classifies failures does not show an empty cell."""
    from dlrover_core.plugins.registry import RECORD_KINDS

    registering = {k.hook for k in RECORD_KINDS.values()}
    other = [h.removeprefix("dlrover_") for h in info.get("hooks", []) if h not in registering]
    return ", ".join([*info["provides"], *(f"hook:{h}" for h in other)]) or "-"


def cmd_plugins_list(args: argparse.Namespace) -> int:
    from rich.markup import escape

    infos = [i.as_dict() for i in _pm().plugins()]
    if args.json:
        print_json(infos)
        return 0
    style = {"active": "green", "blocked": "yellow", "failed": "red"}
    print_table(("name", "version", "distribution", "status", "provides", "error"),
                ((escape(i["name"]), escape(i["version"]), escape(i["distribution"]),
                  f"[{style[i['status']]}]{i['status']}[/]", escape(provides_cell(i)),
                  escape(i["error"])) for i in infos), title="dlrover plugins")
    return 0


def _role_cell(role: dict) -> str:
    """``name``, ``name*`` (required) or ``<pattern>...`` (any number of such roles)."""
    if role["pattern"]:
        return role["name"] + "..."
    return role["name"] + ("*" if role["required"] else "")


def cmd_templates_list(args: argparse.Namespace) -> int:
    templates = _pm().templates()
    rows = [{"name": t.name, "provider": t.provider, "description": t.description,
             "roles": [{"name": r.name, "required": r.required, "description": r.description,
                        "pattern": r.pattern} for r in t.roles],
             "edges": [list(e) for e in t.edges], "driver": t.driver}
            for t in templates.values()]
    if args.json:
        print_json(rows)
        return 0
    print_table(("name", "plugin", "roles (* required, ... any number)", "driver",
                 "description"),
                ((r["name"], r["provider"],
                  ", ".join(_role_cell(x) for x in r["roles"]),
                  r["driver"] or "-", r["description"]) for r in rows),
                title="graph templates")
    return 0


def _load(args: argparse.Namespace):
    from dlrover_core.spec.loader import load_spec

    return load_spec(args.job, args.overrides)


def cmd_validate(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from dlrover_core.cli.imports import check_imports

    spec = _load(args)
    check_imports(spec, args.working_dir)
    print(OmegaConf.to_yaml(spec))
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from dlrover_core.cli.progress import print_summary
    from dlrover_core.master.client import submit_job

    from dlrover_core.master.dir_lock import DirInUseError

    spec = _load(args)
    if args.working_dir and not os.path.isdir(args.working_dir):
        from dlrover_core.spec.errors import SpecError

        raise SpecError("--working-dir", args.working_dir, "an existing directory")
    if not args.no_import_check:
        # every check `validate` runs, before anything starts or a run number is taken
        from dlrover_core.cli.imports import check_imports

        check_imports(spec, args.working_dir)
    if args.no_wait and args.address is None:
        err.print("[bold red]error:[/] --no-wait needs a Ray cluster that outlives this "
                  "command (the default one would stop with it): give --address, e.g. "
                  "`dlrover cluster up` then `--address auto`", highlight=False)
        return 2
    try:
        summary = submit_job(spec, address=args.address, job_dir=args.job_dir,
                             progress=not args.no_progress, verbose=args.verbose,
                             fresh=args.fresh, working_dir=args.working_dir,
                             wait=not args.no_wait)
    except DirInUseError as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 3
    if args.no_wait:
        if args.json:
            print_json(summary)
        else:
            name, jd = summary["name"], summary["job_dir"]
            print(f"submitted {name} (run {summary['run']}) in {jd}")
            print(f"  follow it: dlrover status {name} | dlrover logs {name} -f "
                  f"| dlrover stop {name} (add --job-dir {jd} when the name is ambiguous)")
        return 0
    if summary is None:
        err.print("the job ended without a summary")
        return 1
    if args.json:
        print_json(summary)
    else:
        print_summary(summary)
    job_dir = os.path.abspath(args.job_dir or os.path.join("runs", spec.name))
    run = summary.get("run")
    err.print(f"job directory: {job_dir} "
              + (f"(run {run})" if run is not None else "(no run started)"),
              highlight=False, markup=False)
    return EXIT_CODES.get(summary.get("status"), 1)


def cmd_schema(args: argparse.Namespace) -> int:
    import json

    from dlrover_core.spec.json_schema import job_spec_schema, registered_names

    schema = job_spec_schema(None if args.no_plugins else registered_names(_pm()))
    text = json.dumps(schema, indent=1) + "\n"
    if args.output:
        from dlrover_core.atomic_io import atomic_write_text

        atomic_write_text(args.output, text)
        err.print(f"wrote {args.output}; name it in a job file's first line for "
                  f"yaml-language-server: # yaml-language-server: $schema={args.output}",
                  highlight=False, markup=False)
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlrover", description="control plane for distributed "
                                "deep-learning jobs on Ray")
    p.add_argument("--version", action="version", version=f"dlrover-core {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    plugins = sub.add_parser("plugins", aliases=["plugin"],
                             help="installed plugins; a new plugin package")
    psub = plugins.add_subparsers(dest="sub", required=True)
    pl = psub.add_parser("list", help="list plugins with status and what they provide")
    pl.add_argument("--json", action="store_true", help="a sorted JSON list")
    pl.set_defaults(func=cmd_plugins_list)
    plugin_new.add_parser(psub)

    sc = sub.add_parser("schema", help="the job spec's JSON Schema (for an editor's "
                        "yaml-language-server: completion and checks of job.yaml)")
    sc.add_argument("-o", "--output", default=None, metavar="FILE",
                    help="write it to FILE (default: print it)")
    sc.add_argument("--no-plugins", action="store_true",
                    help="leave out the names the installed plugins register (templates, "
                         "savers, backends, placements, tuners) as enums")
    sc.set_defaults(func=cmd_schema)

    templates = sub.add_parser("templates", help="graph templates")
    tsub = templates.add_subparsers(dest="sub", required=True)
    tl = tsub.add_parser("list", help="list graph templates with their roles")
    tl.add_argument("--json", action="store_true")
    tl.set_defaults(func=cmd_templates_list)

    for name, func, hlp in (("submit", cmd_submit, "run a job and wait for it"),
                            ("validate", cmd_validate, "check a job spec and print it resolved")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("job", help="job spec YAML")
        s.add_argument("overrides", nargs="*", help="key=value overrides (OmegaConf dot-list)")
        s.add_argument("--working-dir", default=None, metavar="DIR",
                       help="the directory the job's code is imported from (shipped to the "
                            "cluster as Ray's runtime_env working_dir; default: the "
                            "current directory, not shipped)")
        if name == "submit":
            s.add_argument("--address", default=None,
                           help="Ray cluster to join ('auto' or HOST:PORT); default: start a "
                                "local cluster")
            s.add_argument("--job-dir", default=None, help="job directory (default runs/NAME)")
            s.add_argument("--no-import-check", action="store_true",
                           help="do not import the roles' workloads and the driver here "
                                "before submitting (as `validate` does): for code whose "
                                "dependencies exist only on the cluster")
            s.add_argument("--fresh", action="store_true",
                           help="start over instead of resuming: the job's checkpoints are "
                                "moved to <job_dir>/run-<N>/ckpt (kept, not deleted)")
            s.add_argument("--no-wait", action="store_true",
                           help="return once the job started (detach; needs --address): "
                                "print its name and how to follow it")
            s.add_argument("--no-progress", action="store_true", help="no progress bar")
            s.add_argument("--verbose", "-v", action="store_true",
                           help="print every rank's output (from the job's logs) on stderr, "
                                "each line labelled [role-rank aATTEMPT]")
            s.add_argument("--json", action="store_true",
                           help="print the final summary as JSON instead of a table")
        s.set_defaults(func=func)

    st = sub.add_parser("status", help="state of a job")
    st.add_argument("name", help="job name, or a job directory")
    st.add_argument("--address", default=None)
    st.add_argument("--job-dir", default=None)
    st.add_argument("--run", default=None, type=run_option,
                    help="an earlier run's summary (N or run-N; default: the latest run)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    sp = sub.add_parser("stop", help="stop a running job")
    sp.add_argument("name", help="job name, or a job directory")
    sp.add_argument("--address", default=None)
    sp.add_argument("--job-dir", default=None)
    sp.set_defaults(func=cmd_stop)

    dl = sub.add_parser("delete", help="remove a finished job's directory and buffers")
    dl.add_argument("name", help="job name, or a job directory")
    dl.add_argument("--address", default=None)
    dl.add_argument("--job-dir", default=None)
    dl.set_defaults(func=cmd_delete)

    jobs_list.add_parser(sub)
    cluster.add_parser(sub)
    logs.add_parser(sub)
    timeline_cmd.add_parser(sub)
    diagnose.add_parser(sub)
    hooks_doc.add_parser(sub)
    _pm().add_cli_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from dlrover_core.cli.job_files import AmbiguousJobError
    from dlrover_core.master.ray_auth import ClusterAuthError
    from dlrover_core.plugins.manager import PluginError, UnknownPluginError
    from dlrover_core.spec.errors import SpecError

    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        return int(args.func(args) or 0)
    except (SpecError, UnknownPluginError, PluginError, FileNotFoundError,
            AmbiguousJobError, ClusterAuthError) as exc:
        err.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    except BrokenPipeError:  # `dlrover ... | head`: the reader left; not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def parse_args(parser: argparse.ArgumentParser,
               argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` allowing options and ``key=value`` overrides in any order.

    argparse stops filling a ``nargs="*"`` positional at the first option, so
    ``submit job.yaml --job-dir D lr=1e-3`` leaves ``lr=1e-3`` unrecognized; for a
    command with ``overrides`` those leftovers are appended to them in the order
    given. Anything else left over (an unknown ``--option``) is an error, as before.
    """
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides"):
        unknown = [x for x in extra if x.startswith("-")]
        if not unknown:
            args.overrides = list(args.overrides or []) + extra
            extra = []
    if extra:
        parser.error("unrecognized arguments: " + " ".join(extra))
    return args


if __name__ == "__main__":
    sys.exit(main())
