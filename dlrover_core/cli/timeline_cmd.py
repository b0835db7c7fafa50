"""``dlrover timeline JOB [-o timeline.png] [--job-dir DIR] [--run N] [--json]``: one run
of the job (the latest by default), so the time between runs is not counted."""

from __future__ import annotations

import argparse

from dlrover_core.cli.job_files import add_job_arguments
from dlrover_core.cli.output import print_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("timeline", help="draw a job's timeline (instances, failures, "
                       "recoveries, checkpoints, goodput) from its job directory")
    add_job_arguments(p)
    p.add_argument("-o", "--output", default="timeline.png",
                   help="image to write (.png, .svg, .pdf; default timeline.png)")
    p.add_argument("--json", action="store_true",
                   help="print the drawn data as JSON instead of drawing")
    p.set_defaults(func=cmd_timeline)


def cmd_timeline(args: argparse.Namespace) -> int:
    from dlrover_core.cli.job_files import JobFiles, resolve_job_dir
    from dlrover_core.cli.timeline_model import build_timeline

    files = JobFiles.read(resolve_job_dir(args.job, args.job_dir), args.run)
    tl = build_timeline(files)
    if args.json:
        print_json({"run": files.run, **tl.as_dict()})
        return 0
    from dlrover_core.cli.timeline_plot import save_timeline

    save_timeline(tl, args.output)
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in tl.breakdown.items())
    print(f"wrote {args.output} (run {files.run}): {len(tl.rows)} instances, "
          f"{len(tl.failures)} failures, "
          f"{len(tl.recoveries)} recoveries, {len(tl.checkpoints)} checkpoints; "
          f"wall {tl.wall_s:.1f} s = {parts}")
    return 0
