"""Throughput is samples over the wall time of a window, data waits included.

A loader that delivers in bursts (three batches at once, then a long wait: what a few
loader workers with slow reads do) makes most steps fast and a few slow. The median of
per-step rates then reports the fast steps' rate, several times the real one; the
window rate the controller, the tuners and the progress bar use must equal the
samples trained over the wall time they took."""

from __future__ import annotations

import time

import pytest

from dlrover_core.tuning.controller import TuningController
from dlrover_core.tuning.guard import Guard
from dlrover_core.tuning.metrics import StepTimer
from dlrover_core.tuning.tuner import TunerBase

SAMPLES = 8          # global samples per step
BURST = 4            # one wait per BURST batches
WAIT_S = 0.09        # the wait before a burst
COMPUTE_S = 0.01


class BurstyLoader:
    """Every ``BURST``-th batch waits ``WAIT_S`` (the next reads), the others are ready."""

    def __init__(self) -> None:
        self.n = 0

    def __next__(self) -> list[int]:
        if self.n % BURST == 0:
            time.sleep(WAIT_S)
        self.n += 1
        return list(range(SAMPLES))


class Recorder(TunerBase):
    """Proposes nothing; keeps the windows it is shown."""

    def __init__(self, options=None):
        super().__init__(options)
        self.windows = []

    def propose(self, window, current):
        self.windows.append(window)
        return None


def test_window_rate_is_samples_over_wall_time_with_a_bursty_loader():
    rec = Recorder()
    ctl = TuningController([("recorder", rec)], role="trainer", world_size=1,
                           interval_steps=12, warmup_steps=0, guard=Guard(windows=2))
    ctl.sync("trainer", 0, {"dataloader": {"batch_size": SAMPLES}})
    timer, loader = StepTimer(rate_window=8), BurstyLoader()
    ends, per_step = [], []
    t0 = time.perf_counter()
    for step in range(24):
        timer.start_step()
        with timer.phase("data"):
            next(loader)
        with timer.phase("compute"):
            time.sleep(COMPUTE_S)
        m = timer.end_step(samples=SAMPLES)
        ends.append(time.perf_counter())
        per_step.append(SAMPLES / m["step_s"])
        ctl.on_report("trainer", 0, step, {**m, "tuning_version": 0})
    true_rate = 24 * SAMPLES / (ends[-1] - t0)

    assert len(rec.windows) == 1 and rec.windows[0].steps == 24
    window = rec.windows[0]
    assert window.samples == 24 * SAMPLES
    assert window.samples_per_s == pytest.approx(true_rate, rel=0.05)
    assert len(window.window_rates) == 2
    # the median of per-step rates sees the steps whose batch was waiting: far off
    per_step.sort()
    median = (per_step[11] + per_step[12]) / 2
    assert median > 2 * true_rate
    # what the progress bar shows: the last rate_window steps' samples over their wall
    last8 = 8 * SAMPLES / (ends[-1] - ends[-9])
    assert m["samples_per_s"] == pytest.approx(last8, rel=0.05)
    assert m["interval_s"] >= m["step_s"] > 0


def test_each_step_reports_its_minor_faults_and_involuntary_switches():
    """``minor_faults`` and ``involuntary_switches`` of a step are that step's own:
    a step that touches 64 MiB of fresh memory faults in at least its 16,384 pages,
    and the next step, which touches none, far fewer."""
    import mmap

    timer = StepTimer()
    timer.start_step()
    with timer.phase("compute"):
        m = mmap.mmap(-1, 64 << 20)
        for off in range(0, 64 << 20, 4096):
            m[off] = 1
    faulting = timer.end_step(samples=1)
    m.close()
    timer.start_step()
    with timer.phase("compute"):
        sum(range(1000))
    quiet = timer.end_step(samples=1)
    assert faulting["minor_faults"] >= (64 << 20) // 4096
    assert quiet["minor_faults"] < 1000
    # involuntary switches depend on the machine's load: present, counted the same way
    assert {"minor_faults", "involuntary_switches"} <= set(quiet)


def test_a_pause_between_steps_is_out_of_the_next_interval():
    """``note_pause`` (a job paused from outside between two steps): the paused seconds
    are not in the next step's ``interval_s`` nor in ``samples_per_s``."""
    timer = StepTimer(rate_window=1)
    timer.start_step()
    timer.end_step(samples=10)
    time.sleep(0.3)                  # paused between the steps
    timer.note_pause(0.3)
    timer.start_step()
    m = timer.end_step(samples=10)
    assert m["interval_s"] < 0.3, m   # without note_pause it holds the 0.3 s
    timer.start_step()
    time.sleep(0.3)
    unpaused = timer.end_step(samples=10)
    assert unpaused["interval_s"] >= 0.3
    with pytest.raises(ValueError, match="seconds >= 0"):
        timer.note_pause(-1)
