"""``benchmarks/elastic.py``'s figures without a cluster: both sides' resume time is the
first step completed at the new world size after the removal (a survivor's in-flight
step at the old size does not count), and ``--runs`` reports medians, min and max over
every run."""

from __future__ import annotations


import pytest

from tests.script_files import load_script

@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/elastic.py", "elastic_bench")


def test_resume_counts_only_steps_at_the_new_world_size(bench):
    steps = [{"ts": 1.0, "world": 3}, {"ts": 2.0, "world": 3},
             {"ts": 10.5, "world": 3},   # a survivor's in-flight step after the removal
             {"ts": 14.0, "world": 2}, {"ts": 15.0, "world": 2}]
    assert bench.resume_after(steps, 10.0) == 4.0
    assert bench.resume_after(steps, None) is None
    assert bench.resume_after(steps[:3], 10.0) is None  # never resumed at another size
    assert bench.resume_after(steps, 0.5) is None  # no step before the removal


def test_runs_report_median_spread_and_every_run(bench):
    runs = [{"world_sizes": [[3, -1]], "resume_after_loss_s": x,
             "ray_train_resume_after_loss_s": y, "ratio": x / y, "samples_lost": 0,
             "samples_duplicated": 0, "samples_reread_after_rollback": 24,
             "goodput": None} for x, y in ((2.0, 10.0), (6.0, 10.0), (3.0, 12.0))]
    out = bench.summarize(runs)
    assert out["resume_after_loss_s"] == 3.0
    assert out["spread"]["resume_after_loss_s"] == {"median": 3.0, "min": 2.0, "max": 6.0,
                                                    "n": 3}
    assert out["ratio"] == 0.25
    assert out["goodput"] is None and out["spread"]["goodput"]["n"] == 0
    assert out["runs"] == runs and len(out["world_sizes"]) == 3


def test_both_sides_remove_the_highest_ranks_node_and_same_settings_is_earned(bench):
    nodes = {0: "n0", 1: "n1", 2: "n2"}
    assert bench.victim(nodes) == ("n2", 2)
    assert bench.victim(nodes, avoid="n2") == ("n1", 1)  # ours: not the JobMaster's node
    run = {"replacement_timeout_s": 60.0, "removed_highest_rank": True,
           "ray_train_removed_highest_rank": True,
           "ray_train_settings": {"worker_group_start_timeout_s": 60.0}}
    assert bench.same_settings([run, dict(run)]) is True
    assert bench.same_settings([run, dict(run, removed_highest_rank=False)]) is False
    assert bench.same_settings([dict(run, ray_train_error="not installed")]) is False
    assert bench.same_settings([dict(run, ray_train_settings={
        "worker_group_start_timeout_s": 2.0})]) is False
    assert bench.same_settings([]) is False
    assert bench.summarize([dict(run, world_sizes=[[3, -1]])])["same_settings"] is True
