"""The plot scripts of the benchmarks without running a benchmark: they read the JSON
lines a benchmark printed (skipping log lines), take the median and spread over runs,
draw the PNG, and name a file that holds no such line."""

from __future__ import annotations

import json
import os

import pytest

from tests.script_files import load_script


def _run(ranks: int, cpu: float, reattach: float) -> dict:
    row = {"ranks": ranks, "master_cpu": cpu, "baseline_cpu": cpu / 2, "lag_p99_s": 0.01,
           "baseline_lag_p99_s": 0.005, "reattach_s": reattach,
           "restart_to_reattached_s": reattach + 1, "master_rss_bytes": 1e8,
           "reports_per_s": ranks / 80}
    return {"benchmark": "master_scale", "rows": [row]}


def test_master_scale_plot_takes_medians_over_runs_and_names_a_wrong_file(tmp_path):
    plot = load_script("benchmarks/plot_master_scale.py", "plot_master_scale")
    runs = tmp_path / "runs.jsonl"
    runs.write_text("\n".join(["run 1 starting", json.dumps(_run(1000, 0.04, 0.3)),
                               "(raylet) a log line", json.dumps(_run(1000, 0.05, 0.5)),
                               json.dumps(_run(1000, 0.09, 0.4)),
                               json.dumps({"benchmark": "other", "rows": []})]))
    got = plot.summarize(plot.read_runs([str(runs)]))
    assert got[1000]["master_cpu"] == (0.05, 0.04, 0.09)  # median, min, max
    assert got[1000]["reattach_s"] == (0.4, 0.3, 0.5)
    out = tmp_path / "scale.png"
    assert plot.main([str(runs), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "other.jsonl"
    other.write_text('{"results": []}\nnot json\n')
    with pytest.raises(SystemExit, match="other.jsonl.*master_scale"):
        plot.read_runs([str(runs), str(other)])


def test_flash_sizes_plot_reads_results_lines_and_names_a_wrong_file(tmp_path):
    plot = load_script("benchmarks/plot_flash_sizes.py", "plot_flash_sizes")
    runs = tmp_path / "flash.jsonl"
    runs.write_text("a log line\n" + json.dumps({"results": [{"size_mib": 64}]}) + "\n")
    assert plot.read_runs([str(runs)]) == [[{"size_mib": 64}]]
    with pytest.raises(SystemExit, match="missing.jsonl"):
        plot.read_runs([os.path.join(str(tmp_path), "missing.jsonl")])
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"benchmark": "master_scale"}\n')
    with pytest.raises(SystemExit, match="empty.jsonl.*results"):
        plot.read_runs([str(empty)])
