"""Plot ``benchmarks/master_scale.py`` runs: master CPU, p99 lag and re-attach time
against the rank count.

    .venv/bin/python benchmarks/plot_master_scale.py runs.jsonl -o docs/master-scale.png

``runs.jsonl``: one or more files of the benchmark's output; every line that is a JSON
object with ``"benchmark": "master_scale"`` is one run (other lines are skipped). Each
point is the median over the runs of one rank count, with a bar from the smallest to
the largest value. Three panels, x = ranks (log scale): ``master_cpu`` beside
``baseline_cpu`` (the no-op actor with the same traffic; 1.0 = a core) with the 20 %
target; ``lag_p99_s`` beside ``baseline_lag_p99_s`` with the 1 s target (log y); ``reattach_s``
and ``restart_to_reattached_s`` with the 10 s target. Prints the medians as one JSON
line.

Raises ``SystemExit`` naming the file when a file holds no run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_output import json_objects  # noqa: E402

KEYS = ("master_cpu", "baseline_cpu", "lag_p99_s", "baseline_lag_p99_s", "reattach_s",
        "restart_to_reattached_s", "master_rss_bytes", "reports_per_s")


def read_runs(paths: list[str]) -> list[dict]:
    """The benchmark's JSON lines in ``paths`` (every other line is skipped).

    Raises:
        SystemExit: a file cannot be read or holds no ``master_scale`` line.
    """
    return json_objects(paths, lambda obj: obj.get("benchmark") == "master_scale",
                        "benchmarks/master_scale.py output (a JSON object with "
                        "\"benchmark\": \"master_scale\")")


def summarize(runs: list[dict]) -> dict[int, dict[str, tuple[float, float, float]]]:
    """ranks -> key -> (median, min, max) over the runs' rows of that rank count."""
    values: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        for row in run["rows"]:
            for key in KEYS:
                if row.get(key) is not None:
                    values[row["ranks"]][key].append(float(row[key]))
    return {n: {k: (statistics.median(v), min(v), max(v)) for k, v in per.items()}
            for n, per in sorted(values.items())}


def plot(summary: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(summary)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        (axes[0], [("master_cpu", "JobMaster"), ("baseline_cpu", "no-op actor, same calls")],
         0.2, "CPU (1.0 = one core)", "master CPU at 1 step/s per rank"),
        (axes[1], [("lag_p99_s", "JobMaster"), ("baseline_lag_p99_s", "no-op actor")],
         1.0, "p99 report lag (s)", "report round trip, p99"),
        (axes[2], [("reattach_s", "re-attach (master_reattached.seconds)"),
                   ("restart_to_reattached_s", "SIGKILL to re-attached")],
         10.0, "seconds", "restarted master re-attaches"),
    ]
    for ax, series, target, ylabel, title in panels:
        for key, label in series:
            xs = [n for n in ranks if key in summary[n]]
            if not xs:
                continue
            med = [summary[n][key][0] for n in xs]
            lo = [summary[n][key][0] - summary[n][key][1] for n in xs]
            hi = [summary[n][key][2] - summary[n][key][0] for n in xs]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xscale("log")
        if target == 1.0:  # lags of ms against a 1 s target
            ax.set_yscale("log")
        ax.set_xlabel("simulated ranks (8 per node, one agent each)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="files with the benchmark's output")
    ap.add_argument("-o", "--out", default="docs/master-scale.png", help="the PNG to write")
    args = ap.parse_args(argv)
    runs = read_runs(args.files)
    summary = summarize(runs)
    plot(summary, args.out)
    print(json.dumps({"runs": len(runs), "out": args.out, "medians": {
        str(n): {k: v[0] for k, v in per.items()} for n, per in summary.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
