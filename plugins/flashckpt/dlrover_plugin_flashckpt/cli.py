"""``dlrover flash``: look at and clean the flash-checkpoint buffers of this machine.

    dlrover flash ls [--shm-dir DIR] [--json]
    dlrover flash clean [--shm-dir DIR] [--job NAME [--force]]

``ls`` marks ``NOT PERSISTED`` a buffer holding a step newer than the newest committed
step of its directory. ``clean`` removes stale buffers (their trainer and persister
processes are gone) except those; ``--job NAME`` removes every buffer of that job,
live or not, except those, and ``--force`` removes those too.
"""

from __future__ import annotations

import argparse
import json


def cmd_ls(args: argparse.Namespace) -> int:
    from dlrover_plugin_flashckpt.hygiene import describe

    rows = describe(args.shm_dir)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no flash-checkpoint buffers in {args.shm_dir}")
    for r in rows:
        print(f"{r['name']}  job={r.get('job')} role={r.get('role')} rank={r.get('rank')} "
              f"step={r.get('step')} state={r['state']} {r.get('bytes', 0) / 2**20:.1f} MiB"
              + ("  NOT PERSISTED" if r.get("not_persisted") else "")
              + (f"  {r['error']}" if r.get("error") else ""))
    return 0


def cmd_clean(args: argparse.Namespace) -> int:
    from dlrover_plugin_flashckpt.hygiene import remove_job, remove_stale

    kept: list[dict] = []
    removed = (remove_job(args.shm_dir, args.job, keep_unpersisted=not args.force, kept=kept)
               if args.job else remove_stale(args.shm_dir, ""))
    for name in removed:
        print(f"removed {name}")
    for k in kept:
        print(f"kept {k['name']}: step {k['step']} is not persisted in {k['dir']} "
              "(--force removes it)")
    print(f"{len(removed)} buffer(s) removed from {args.shm_dir}")
    return 0


def add_commands(cli: argparse._SubParsersAction) -> None:
    p = cli.add_parser("flash", help="flash-checkpoint shared-memory buffers on this machine")
    sub = p.add_subparsers(dest="sub", required=True)
    ls = sub.add_parser("ls", help="list the buffers with job, rank, step and state")
    ls.add_argument("--shm-dir", default="/dev/shm")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)
    cl = sub.add_parser("clean", help="remove stale buffers (or every buffer of --job)")
    cl.add_argument("--shm-dir", default="/dev/shm")
    cl.add_argument("--job", default=None, help="remove every buffer of this job")
    cl.add_argument("--force", action="store_true",
                    help="with --job: also remove buffers holding a step not persisted")
    cl.set_defaults(func=cmd_clean)
