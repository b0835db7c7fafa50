"""Plot the figures of ``benchmarks/flash_checkpoint.py --sizes-mib ...`` against the
state size.

Reads the JSON lines the benchmark prints (``{"results": [...]}``; other lines of a
saved log are skipped) from one or more files, one run per line. Several runs: each
point is the median over the runs of that size, with error bars from the smallest to
the largest value. Two panels:

- ratios against the size per rank (MiB, log x): ``save_over_memcpy`` (flash save /
  memcpy bound), ``first_over_steady`` (seconds of the first save / of a steady save),
  ``load_cold_vs_preadv`` (fresh saver's load / bare ``preadv`` bound),
  ``load_warm_vs_memcpy`` (the saving saver's own load / memcpy) and
  ``persist_vs_write_fsync`` (persister / bare ``write`` + ``fsync``) and
  ``persist_write_vs_write_fsync`` (the same without the commit); a ratio missing
  from every run (an older benchmark) is left out, with a note on stderr;
- ``peak_rss_trainer_bytes`` and ``peak_rss_persister_bytes`` against ``state_bytes``
  (GiB, log-log), with the line y = state bytes.

It prints the medians it plots, one line per size, on stdout.

    .venv/bin/python benchmarks/plot_flash_sizes.py RUN1.jsonl [RUN2.jsonl ...] \\
        -o docs/flash-sizes.png

Exits with status 1 and a message naming the file when a file cannot be read or
holds no line with ``results``.
"""

from __future__ import annotations

import argparse
import statistics
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_output import json_objects  # noqa: E402

GIB = float(1 << 30)

#: (result key, legend label) of the ratio panel
RATIOS = [
    ("save_over_memcpy", "flash save / memcpy (GiB/s)"),
    ("first_over_steady", "first save / steady save (seconds)"),
    ("load_cold_vs_preadv", "cold load / preadv bound (GiB/s)"),
    ("load_warm_vs_memcpy", "warm load / memcpy (GiB/s)"),
    ("persist_vs_write_fsync", "persist / write+fsync (GiB/s)"),
    ("persist_write_vs_write_fsync", "persist, files only / write+fsync (GiB/s)"),
]
#: (result key, legend label) of the memory panel
RSS = [("peak_rss_trainer_bytes", "peak RSS, trainer"),
       ("peak_rss_persister_bytes", "peak RSS, persister")]


def read_runs(paths: list[str]) -> list[list[dict]]:
    """The ``results`` list of every JSON line with one, over ``paths`` in order.

    Raises:
        SystemExit: a file cannot be read or has no such line."""
    return [obj["results"] for obj in json_objects(
        paths, lambda obj: isinstance(obj.get("results"), list),
        "benchmarks/flash_checkpoint.py output (a JSON object with 'results')")]


def by_size(runs: list[list[dict]], key: str) -> dict[int, list[float]]:
    """``size_mib -> [value of key in each run]`` (runs without the key, or ``null``,
    left out)."""
    out: dict[int, list[float]] = {}
    for results in runs:
        for r in results:
            v = r.get(key)
            if isinstance(v, (int, float)):
                out.setdefault(int(r["size_mib"]), []).append(float(v))
    return out


def spread(values: dict[Any, list[float]]) -> tuple[list, list[float], list[list[float]]]:
    """Sorted keys, medians, and ``[below, above]`` error bar lengths (min, max)."""
    keys = sorted(values)
    med = [statistics.median(values[k]) for k in keys]
    err = [[m - min(values[k]) for k, m in zip(keys, med)],
           [max(values[k]) - m for k, m in zip(keys, med)]]
    return keys, med, err


def plot(runs: list[list[dict]], out: str) -> list[str]:
    """Draw both panels into ``out`` (PNG); returns the lines of medians printed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    table: dict[int, dict[str, float]] = {}
    for key, label in RATIOS:
        vals = by_size(runs, key)
        if not vals:
            print(f"plot_flash_sizes: no {key} in any run; left out", file=sys.stderr)
            continue
        sizes, med, err = spread(vals)
        ax1.errorbar(sizes, med, yerr=err, marker="o", capsize=3, label=label)
        for s, m in zip(sizes, med):
            table.setdefault(s, {})[key] = m
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(sorted(table), [str(s) for s in sorted(table)])
    ax1.set_xlabel("state per rank (MiB)")
    ax1.set_ylabel("ratio")
    ax1.set_title(f"flash checkpoint against its bounds ({len(runs)} run(s): median, min-max)")
    ax1.legend(fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)

    states = by_size(runs, "state_bytes")
    lo = hi = None
    for key, label in RSS:
        vals = by_size(runs, key)
        if not vals:
            print(f"plot_flash_sizes: no {key} in any run; left out", file=sys.stderr)
            continue
        # x: the state's bytes of that size (the same in every run)
        sizes, med, err = spread(vals)
        xs = [statistics.median(states[s]) / GIB for s in sizes]
        ax2.errorbar(xs, [m / GIB for m in med], yerr=[[e / GIB for e in side] for side in err],
                     marker="o", capsize=3, label=label)
        lo = min(xs) if lo is None else min(lo, min(xs))
        hi = max(xs) if hi is None else max(hi, max(xs))
        for s, m in zip(sizes, med):
            table.setdefault(s, {})[key] = m
    if lo is not None:
        ax2.plot([lo, hi], [lo, hi], color="grey", ls="--", label="y = state bytes")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log", base=2)
    if lo is not None:
        xs = sorted({statistics.median(v) / GIB for v in states.values()})
        ax2.set_xticks(xs, [f"{x:.3g}" for x in xs])
    ax2.set_xlabel("state bytes (GiB)")
    ax2.set_ylabel("peak resident set (GiB)")
    ax2.set_title("peak RSS (VmHWM; mapped slot pages included)")
    ax2.legend(fontsize=8)
    ax2.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    lines = []
    for s in sorted(table):
        lines.append(f"{s} MiB: " + ", ".join(
            f"{k} {v:.0f}" if k.endswith("_bytes") else f"{k} {v:.3f}"
            for k, v in table[s].items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="files with the benchmark's JSON line(s)")
    p.add_argument("-o", "--out", default="docs/flash-sizes.png", help="PNG to write")
    args = p.parse_args(argv)
    runs = read_runs(args.results)
    for line in plot(runs, args.out):
        print(line)
    print(f"wrote {args.out} from {len(runs)} run(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
