"""``dlrover plugin new NAME --kind KIND [--dir DIR] [--force]``."""

from __future__ import annotations

import argparse
import os
import sys

from dlrover_core.cli.output import console_for


def add_parser(psub: argparse._SubParsersAction) -> None:
    """Add ``new`` to the ``plugin``/``plugins`` sub-commands."""
    from dlrover_core.cli.scaffold.kinds import KINDS

    p = psub.add_parser("new", help="write a new plugin package (installable, with tests)")
    p.add_argument("name", help="plugin name (lower case; the package is dlrover-plugin-NAME)")
    p.add_argument("--kind", required=True, choices=sorted(KINDS),
                   help="what the plugin provides")
    p.add_argument("--dir", default=".", help="where to create dlrover-plugin-NAME/ "
                   "(default: the current directory)")
    p.add_argument("--force", action="store_true", help="write into an existing directory")
    p.set_defaults(func=cmd_plugin_new)


def cmd_plugin_new(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from dlrover_core.cli.scaffold import ScaffoldError, new_plugin

    try:
        root = new_plugin(args.name, args.kind, args.dir, force=args.force)
    except ScaffoldError as exc:
        console_for(stderr=True).print(f"[bold red]error:[/] {escape(str(exc))}",
                                       highlight=False)
        return 2
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    print(f"created {root}/")
    for f in files:
        print(f"  {f}")
    py = _interpreter()
    print(f"next: {py} -m pip install -e '{root}[test]' && {py} -m pytest -q {root}/tests")
    return 0


def _interpreter() -> str:
    """The interpreter that runs ``dlrover`` (its venv's ``python``, where the new plugin
    must be installed), relative to the current directory when it lies below it
    (``.venv/bin/python``), as the README writes it."""
    py = sys.executable or "python"
    rel = os.path.relpath(py)
    return rel if not rel.startswith("..") else py
