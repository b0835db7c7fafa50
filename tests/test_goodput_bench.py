"""``benchmarks/goodput.py``'s account of where a run's wall time went, on the
hand-written job directory of ``test_cli_timeline_model`` (exact numbers)."""

from __future__ import annotations

from tests.script_files import load_script
from tests.test_cli_timeline_model import EVENTS, STEPS, T0, write_job


def test_where_lost_splits_steady_steps_from_the_gap_a_kill_falls_in(tmp_path):
    bench = load_script("benchmarks/goodput.py", "goodput_bench")
    job = write_job(tmp_path / "toy", EVENTS, STEPS,
                    {"name": "toy", "status": "succeeded", "goodput": 0.5, "wall_s": 20.0})
    got = bench.where_lost(job, [T0 + 9.0])   # rank 1 killed at 9 s, after step 6
    # steps 0..6 one second apart, 7..15 half a second apart; 6 -> 7 (9 s -> 13.5 s)
    # holds the kill: out of the steady figures
    assert got["step_s_median"] == 0.5
    assert got["step_s_mean"] == round((6 * 1.0 + 8 * 0.5) / 14, 4)
    assert got["kill_gaps_s"] == 4.5
    assert got["breakdown_s"] == {"productive": 10.0, "startup": 3.0, "recovery": 2.0,
                                  "checkpoint": 0.5, "other": 4.5}
    # no kill: every gap is steady
    assert bench.where_lost(job, [])["kill_gaps_s"] == 0.0


def test_over_runs_and_the_no_fault_median_leave_out_runs_without_a_figure():
    bench = load_script("benchmarks/goodput.py", "goodput_bench")
    runs = [{"goodput": 0.96}, {"goodput": None}, {"goodput": 0.98}]
    assert bench.over_runs(runs, "goodput") == {"median": 0.97, "min": 0.96, "max": 0.98,
                                                "runs": [0.96, None, 0.98]}
    assert bench.over_runs(runs[:1], "goodput") == 0.96
    assert bench.median_of(runs, "goodput") == 0.97
    assert bench.median_of([{"goodput": None}], "goodput") is None
