"""``benchmarks/recovery.py``'s figures without a cluster: the phases of one recovery
add up to the kill -> first step time, and ``--runs`` reports medians, min and max of
every figure and phase over the runs."""

from __future__ import annotations

import argparse

import pytest

from tests.script_files import load_script

@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/recovery.py", "recovery_bench")


def _finished(ts: float) -> dict:
    # the master's record of a process restart (master/recovery.py, launcher.py)
    return {"ts": ts, "event": "recovery_finished", "seconds": 1.0, "phases": {
        "survivors_s": 0.2, "survivor_abort": {"trainer-0": "skipped (gloo)"},
        "standby_used": True, "replace_and_setup_s": 0.7, "actors_started_s": 0.1,
        "setup_s": 0.5, "import_s": 0.05, "process_group_s": 0.15, "user_setup_s": 0.25}}


def test_phases_add_up_to_the_recovery(bench):
    kill, started = 100.0, {"ts": 100.3, "event": "recovery_started"}
    out = bench.recovery_phases(kill, started, _finished(101.3), 101.9)
    assert out["detection_s"] == pytest.approx(0.3)
    assert out["abort_s"] == 0.2 and out["actors_started_s"] == 0.1
    assert out["setup_s"] == 0.5 and out["replace_s"] == pytest.approx(0.1)
    assert out["master_other_s"] == pytest.approx(0.1)
    assert out["first_step_s"] == pytest.approx(0.6)
    assert sum(out[k] for k in bench.PHASES) == pytest.approx(101.9 - kill)
    assert (out["setup_import_s"], out["setup_process_group_s"], out["setup_user_s"]) == \
        (0.05, 0.15, 0.25)


def test_phases_without_a_restart_breakdown(bench):
    started = {"ts": 10.5}
    out = bench.recovery_phases(10.0, started, {"ts": 12.0, "phases": {}}, 12.5)
    assert out["abort_s"] is None and out["setup_s"] is None
    assert out["master_other_s"] == 1.5 and out["first_step_s"] == 0.5
    out = bench.recovery_phases(10.0, started, None, 11.0)  # no finished event yet
    assert out["master_other_s"] == 0.5 and out["first_step_s"] is None
    assert sum(out[k] or 0 for k in bench.PHASES) == pytest.approx(1.0)


def test_analyse_reads_the_job_dir(bench, tmp_path):
    import json

    events = [{"ts": 100.3, "event": "recovery_started"}, _finished(101.3)]
    steps = [{"ts": t, "event": "step", "role": "trainer", "step": s}
             for t, s in ((99.0, 20), (99.5, 21), (101.9, 21), (102.2, 22))]
    for name, recs in (("events.jsonl", events), ("metrics.jsonl", steps)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = bench.analyse(str(tmp_path), [100.0])
    assert out["recovery_s"] == [pytest.approx(1.9)] and out["steps_redone"] == 1
    assert out["phases_s"][0]["first_step_s"] == pytest.approx(0.6)


def test_runs_report_median_spread_and_every_run(bench):
    def ours(rec, ph):
        return {"recovery_s": rec, "steps_redone": 2, "phases_s": {"detection_s": ph}}

    runs = [{"in_place": ours(a, d), "restart_all": ours(b, None),
             "raytrain": {"recovery_s": c, "steps_redone": 5, "ray_train_version": "v2"}}
            for a, b, c, d in ((1.0, 3.0, 10.0, 0.1), (4.0, 2.0, 12.0, 0.3),
                               (2.0, 5.0, 11.0, 0.2))]
    args = argparse.Namespace(steps=40, kill_after_step=15, ckpt_every=10, tiny=True,
                              saver="disk")
    out = bench.summarize(runs, args)
    assert out["ours_path"] == "in_place" and out["ours_recovery_s"] == 2.0
    assert out["ours_restart_all_recovery_s"] == 3.0 and out["raytrain_recovery_s"] == 11.0
    assert out["ratio"] == round(2.0 / 11.0, 3) and out["raytrain_version"] == "v2"
    assert out["spread"]["ours_in_place_recovery_s"] == {"median": 2.0, "min": 1.0,
                                                         "max": 4.0, "n": 3}
    assert out["phases_s"]["in_place"]["detection_s"] == {"median": 0.2, "min": 0.1,
                                                          "max": 0.3, "n": 3}
    assert out["phases_s"]["restart_all"]["detection_s"]["n"] == 0
    assert out["runs"] == runs and out["runs_n"] == 3
    no_rt = [{**r, "raytrain": {}} for r in runs]
    assert bench.summarize(no_rt, args)["ratio"] is None


def test_ratio_less_one_step_takes_a_steady_step_off_each_side(bench, tmp_path):
    import json

    # ours: steps every 0.5 s before the kill at 100.0, first step after it at 101.9
    steps = [{"ts": t, "event": "step", "role": "trainer", "step": s}
             for t, s in ((98.5, 19), (99.0, 20), (99.5, 21), (101.9, 22))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    (tmp_path / "events.jsonl").write_text(json.dumps({"ts": 100.3,
                                                       "event": "recovery_started"}) + "\n")
    a = bench.analyse(str(tmp_path), [100.0])
    assert a["step_s_median"] == 0.5 and a["steps_redone"] == 0
    ours = {"recovery_s": 1.9, "steps_redone": 0,
            "recovery_less_one_step_s": bench.less_one_step(1.9, a["step_s_median"])}
    runs = [{"in_place": ours, "restart_all": {"recovery_s": None},
             "raytrain": {"recovery_s": 10.5, "step_s_median": 0.5, "steps_redone": 3}}]
    args = argparse.Namespace(steps=40, kill_after_step=15, ckpt_every=10, tiny=True,
                              saver="disk", backend="ddp")
    out = bench.summarize(runs, args)
    assert out["ratio"] == round(1.9 / 10.5, 3)
    assert out["ratio_less_one_step"] == round(1.4 / 10.0, 3)
    assert out["steps_redone"] == 0 and out["raytrain_steps_redone"] == 3
