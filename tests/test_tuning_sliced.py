"""The parts of ``benchmarks/tuning.py --sliced``: the known-optimum job's cost model,
the pause at a step boundary (:mod:`examples.slices`) and the interval of the sliced
ratio; and, slow, a real 2-rank job paused and resumed by the benchmark's control."""

from __future__ import annotations

import math
import os
import sys
import threading
import time

import pytest
from omegaconf import OmegaConf

from dlrover_core.tuning.metrics import StepTimer
from examples.known_optimum.workload import optimum, rate
from examples.slices import PauseControl, wait_while_paused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_shipped_known_optimum_job_has_its_optimum_about_twice_the_start():
    c = OmegaConf.to_container(OmegaConf.load(
        os.path.join(ROOT, "examples", "known_optimum", "job.yaml")).config)
    best = optimum(c, max_num_workers=8, max_micro_batch=32)
    # 32 samples a step: micro-batch 32 (0.03 + 32 * 0.002 s) with >= 4 workers (400/s)
    assert (best["num_workers"], best["micro_batch"], best["grad_accum_steps"]) == (4, 32, 1)
    assert best["rate"] == pytest.approx(32 / 0.094)
    # the start: 4 micro-batches of 8 (0.12 + 0.064 s), 2 workers bring 200/s
    assert best["start_rate"] == pytest.approx(32 / 0.184)
    assert 1.9 < best["rate"] / best["start_rate"] < 2.0
    assert rate(0, 8, 32, 0.01, 0.03, 0.002) == pytest.approx(32 / (0.32 + 0.184))
    with pytest.raises(ValueError, match="does not divide"):
        rate(2, 5, 32, 0.01, 0.03, 0.002)


def test_a_paused_rank_stops_before_the_step_and_its_pause_is_out_of_the_interval(tmp_path):
    """One rank (no process group) in a thread: the control's pause returns the step it
    stopped before; after the resume the rank goes on, and the next step's
    ``interval_s`` does not hold the pause."""
    cfg = {"pause_file": str(tmp_path / "pause")}
    ctl = PauseControl(cfg["pause_file"], ranks=1)
    timer, steps, stop = StepTimer(rate_window=1), [], threading.Event()

    def loop():
        step = 0
        while not stop.is_set():
            wait_while_paused(cfg, 0, step, timer)
            timer.start_step()
            time.sleep(0.01)
            steps.append((step, timer.end_step(samples=1)["interval_s"]))
            step += 1

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        time.sleep(0.2)
        at = ctl.pause(timeout_s=30)
        done = len(steps)
        assert at["step"] == done          # stopped before the step after the last done
        time.sleep(0.5)
        assert len(steps) == done          # and stands still
        ctl.resume()
        deadline = time.monotonic() + 30
        while len(steps) < done + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert steps[done][0] == at["step"]
        assert steps[done][1] < 0.5        # the 0.5 s stand-still is not in its interval
        assert ctl.pause(timeout_s=30)["step"] > at["step"]   # a second pause works too
        ctl.resume()
    finally:
        stop.set()
        ctl.resume()
        t.join(10)


def test_the_ninety_percent_interval_of_the_sliced_ratio():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import tuning

    logs = [math.log(x) for x in (0.98, 1.02, 0.99, 1.01, 1.0, 1.0)]
    lo, hi = tuning.interval90(logs, 3)
    assert lo < 1.0 < hi and hi - lo < 0.05
    wide_lo, wide_hi = tuning.interval90(logs, 2)   # fewer degrees of freedom: wider
    assert wide_lo < lo and wide_hi > hi
    assert tuning.interval90([math.log(0.9)], 1) == pytest.approx((0.9, 0.9))


@pytest.mark.slow
def test_a_two_rank_job_is_paused_between_steps_and_goes_on(ray_cluster, tmp_path):
    """The known-optimum job (2 FSDP2 ranks on gloo, its costs shrunk) submitted with its
    pause file present: both ranks stand before step 0; resumed, paused again (both
    ranks before the same step: they agree through an all-reduce) for 3 s, resumed, it
    runs to its end; the step after the second pause has an ``interval_s`` without the
    3 s, and no step is missing or reported twice."""
    import ray

    from dlrover_core import load_spec
    from dlrover_core.master.client import create_master
    from dlrover_core.master.events import read_events
    from dlrover_core.testing import poll_status

    pause = str(tmp_path / "pause")
    open(pause, "w").close()
    steps = 60
    spec = load_spec(os.path.join(ROOT, "examples", "known_optimum", "job.yaml"), [
        "name=sliced-pause", f"+config.pause_file={pause}", f"config.max_steps={steps}",
        "config.read_latency_s=0.001", "config.fixed_s=0.005", "config.per_sample_s=0.0005",
        "config.num_workers=0", "node_health.skip_node_check=true"])
    job_dir = str(tmp_path / "job")
    master = create_master(spec, job_dir)
    ray.get(master.start.remote())
    ctl = PauseControl(pause, ranks=2)
    try:
        # both ranks standing already (their notes written) before the first call, as
        # the second of the sliced benchmark's two jobs: pause() waited for those notes
        # to go and timed out; wait_paused() takes them
        deadline = time.monotonic() + 300
        while not all(os.path.exists(f"{pause}.rank{r}") for r in range(2)):
            assert time.monotonic() < deadline, "the ranks never paused"
            time.sleep(0.1)
        assert ctl.wait_paused(timeout_s=30)["step"] == 0
        ctl.resume()
        time.sleep(1.0)
        at = ctl.pause(timeout_s=120)
        assert 0 < at["step"] < steps
        time.sleep(3.0)
        ctl.resume()
        summary = poll_status(master, lambda st: st["summary"], 300)["summary"]
    finally:
        ctl.resume()
        ray.kill(master, no_restart=True)
    assert summary["status"] == "succeeded", summary.get("error")
    rows = [r for r in read_events(os.path.join(job_dir, "metrics.jsonl"))
            if r["event"] == "step" and "interval_s" in r]
    assert sorted(r["step"] for r in rows) == list(range(steps))
    after = next(r for r in rows if r["step"] == at["step"])
    assert after["interval_s"] < 3.0, after


def test_the_steady_state_starts_at_the_first_slice_wholly_under_the_final_version():
    """A slice whose last step ran under the final version but whose first did not holds
    the trials: it belongs to the tuning cost, not to the steady-state ratio."""
    from tests.script_files import load_script

    bench = load_script("benchmarks/tuning.py", "tuning_bench")
    tuned = [{"samples": 80.0, "seconds": 1.0, "first_version": 0, "version": 3},
             {"samples": 99.0, "seconds": 1.0, "first_version": 3, "version": 3},
             {"samples": 99.0, "seconds": 1.0, "first_version": 3, "version": 3}]
    peer = [{"samples": 100.0, "seconds": 1.0, "first_version": 0, "version": 0}] * 3
    assert bench.steady_start(tuned) == 1
    sliced, cost = bench.sliced_ratio(tuned, peer, 1)
    # pairs in time order: t0 p0 t1 p1 t2 p2; those with t1 or t2: (p0,t1) (t1,p1)
    # (p1,t2) (t2,p2), each 0.99
    assert (sliced["geomean"], sliced["pairs"], sliced["from_slice"]) == (0.99, 4, 1)
    assert sliced["lower90"] == sliced["upper90"] == 0.99   # no spread
    assert cost == {"geomean_before_steady": 0.8, "slices": 1}   # (t0, p0)
    # the last slice changed version (3 -> 4) within itself: no slice ran wholly under
    # the final version, so there is no steady state to measure
    tuned[2] = {**tuned[2], "version": 4, "first_version": 3}
    assert bench.steady_start(tuned) == 3
    assert bench.sliced_ratio(tuned, peer, 3)[0]["geomean"] is None
