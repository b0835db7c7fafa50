"""The guard against noise: step times that vary 3x from step to step (each step's
wall time is its configuration's time multiplied by a uniform factor in [1, 3], from a
seeded generator, so every run of this test sees the same numbers). With the default
guard (3 windows of 10 steps per configuration, one-sided Welch's t-test at 90 %):
a change that is 30 % faster is kept, one 30 % slower is reverted, and one that is as
fast is not flip-flopped (tried, reverted, and not tried again while nothing changed).
A reverted change is retried when the conditions moved, at most ``max_retries``
times. The guard's Welch statistics are scipy's, and samples without spread are
decided where scipy answers nan."""

from __future__ import annotations

import random

import pytest

from dlrover_core.tuning.controller import TuningController
from dlrover_core.tuning.guard import Guard, welch_greater
from dlrover_core.tuning.tuner import TunerBase, WindowSummary

SAMPLES = 64
CHANGE = {"dataloader": {"num_workers": 1}}


class AlwaysPropose(TunerBase):
    """Proposes one worker whenever the loader has none (every round)."""

    def propose(self, window, current):
        return CHANGE if current.dataloader.num_workers == 0 else None


class NoisyJob:
    """Step reports of a job whose step takes ``base_s / speed`` seconds times a factor
    drawn uniformly from [1, 3] (3x per-step noise); ``speed`` is ``trial_speed`` with
    one loader worker, else 1. ``slowdown`` multiplies every step from ``slow_from``
    on (storage got slower: the conditions changed)."""

    def __init__(self, trial_speed: float, seed: int = 0, slowdown: float = 1.0,
                 slow_from: int = 10**9) -> None:
        self.trial_speed, self.rng = trial_speed, random.Random(seed)
        self.slowdown, self.slow_from = slowdown, slow_from

    def step(self, cfg: dict, step: int) -> dict:
        speed = self.trial_speed if cfg["dataloader"]["num_workers"] == 1 else 1.0
        dt = 0.1 / speed * self.rng.uniform(1.0, 3.0)
        if step >= self.slow_from:
            dt *= self.slowdown
        return {"tuning_version": cfg["version"], "samples": SAMPLES, "interval_s": dt,
                "step_s": dt, "data_wait_s": 0.5 * dt, "compute_s": 0.5 * dt,
                "optimizer_s": 0.0, "samples_per_s": SAMPLES / dt}


def run(job: NoisyJob, steps: int, guard: Guard | None = None):
    events: list = []
    ctl = TuningController([("workers", AlwaysPropose())], role="trainer", world_size=1,
                           interval_steps=10, warmup_steps=2, guard=guard or Guard(),
                           emit=lambda e, **f: events.append({"event": e, **f}))
    ctl.sync("trainer", 0, {"dataloader": {"batch_size": 8}})
    workers = []
    for step in range(steps):
        cfg = ctl.current()
        workers.append(cfg["dataloader"]["num_workers"])
        ctl.on_report("trainer", 0, step, job.step(cfg, step))
    return ctl, events, workers


def kinds(events: list) -> list[str]:
    return [e["event"] for e in events if e["event"] in (
        "tuning_proposed", "tuning_retry", "tuning_accepted", "tuning_reverted")]


def test_a_30_percent_gain_is_kept_under_3x_noise():
    ctl, events, workers = run(NoisyJob(1.3), 200)
    assert kinds(events) == ["tuning_proposed", "tuning_accepted"]
    assert workers[-1] == 1 and ctl.summary()["accepted"] == 1
    kept = [e for e in events if e["event"] == "tuning_accepted"][0]
    assert "90% confidence" in kept["reason"] and len(kept["after"]["window_rates"]) == 3
    # the per-step rates are 3x apart, the windows' rates much closer
    rates = kept["after"]["window_rates"]
    assert max(rates) / min(rates) < 1.3


def test_a_30_percent_loss_is_reverted_under_3x_noise():
    ctl, events, workers = run(NoisyJob(0.7), 200)
    assert kinds(events) == ["tuning_proposed", "tuning_reverted"]
    assert workers[-1] == 0
    assert ctl.summary()["reverted"] == 1


@pytest.mark.parametrize("seed", range(5))
def test_an_equal_change_is_not_flip_flopped(seed):
    ctl, events, workers = run(NoisyJob(1.0, seed=seed), 400)
    # tried once, not kept (no gain shown), never proposed again: the settings switch
    # twice in 400 steps, then stay
    assert kinds(events) == ["tuning_proposed", "tuning_reverted"]
    switches = sum(1 for a, b in zip(workers, workers[1:]) if a != b)
    assert switches == 2 and workers[-1] == 0
    assert ctl.summary()["retried"] == 0


def test_a_reverted_change_is_retried_when_conditions_change_at_most_max_retries():
    # the change does not pay (as fast) and is reverted; then storage gets 2x slower
    # and the baseline moves by more than retry_shift: the change is tried once more,
    # and only once (max_retries=1)
    job = NoisyJob(1.0, seed=3, slowdown=2.0, slow_from=80)
    ctl, events, _ = run(job, 160, guard=Guard(max_retries=1))
    ev = kinds(events)
    assert ev[:2] == ["tuning_proposed", "tuning_reverted"]
    assert "tuning_retry" in ev and ev.count("tuning_retry") == 1
    retry = [e for e in events if e["event"] == "tuning_retry"][0]
    assert retry["changes"] == {"dataloader": {"num_workers": [0, 1]}}
    assert ctl.summary()["retried"] == 1
    # with no retries allowed the same run never tries it again
    ctl0, events0, _ = run(NoisyJob(1.0, seed=3, slowdown=2.0, slow_from=80), 160,
                           guard=Guard(max_retries=0))
    assert kinds(events0) == ["tuning_proposed", "tuning_reverted"]


def test_welch_statistics_match_scipy_and_degenerate_samples_are_decided():
    from scipy import stats

    a, b = [130.0, 118.0, 141.0, 125.0], [100.0, 96.0, 111.0]
    res = welch_greater(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False, alternative="greater")
    assert res.t == pytest.approx(ref.statistic) and res.p == pytest.approx(ref.pvalue)
    assert res.df == pytest.approx(ref.df)
    assert welch_greater([1.0, 1.0], [1.0, 1.0]).p == 0.5
    with pytest.raises(ValueError, match="tuning.guard.windows >= 2"):
        welch_greater([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="tuning.guard.confidence: 1.2 is invalid"):
        Guard(confidence=1.2)


def _windows(rates: list[float]) -> WindowSummary:
    return WindowSummary(version=1, steps=4 * len(rates), first_step=0,
                         last_step=4 * len(rates) - 1,
                         samples_per_s=sum(rates) / len(rates), step_s=0.4,
                         data_wait_s=0.0, compute_s=0.4, optimizer_s=0.0,
                         data_wait_share=0.0, memory_bytes=0.0, memory_capacity_bytes=0.0,
                         prefetch_depth=-1.0, world_size=2, window_rates=tuple(rates))


def test_an_undecided_trial_is_measured_to_max_windows_and_judged_again():
    """The windows of a tuned run (docs/tuning.md): a micro-batch trial 10 % faster
    whose second window held an epoch's refill. One look reverts it; with
    max_windows=6 it is measured on, and kept at the second look, each look at half
    the level (p <= 0.05 for 90 % confidence)."""
    before = _windows([131.8, 133.1, 138.4])
    first = _windows([152.3, 136.2, 156.1])
    assert not Guard(min_gain=0.05).judge(before, first).keep
    g = Guard(min_gain=0.05, max_windows=6)
    v = g.judge(before, first)
    assert (v.keep, v.more) == (False, True) and "not yet shown" in v.reason
    assert g.windows_to_judge(True, 3) == 3 and g.windows_to_judge(True, 4) == 6
    assert g.windows_to_judge(False, 4) == 3
    v = g.judge(before, _windows([152.3, 136.2, 156.1, 151.0, 153.5, 152.0]))
    assert v.keep and not v.more
    p = welch_greater([152.3, 136.2, 156.1, 151.0, 153.5, 152.0],
                      [1.05 * r for r in (131.8, 133.1, 138.4)]).p
    assert 0.01 < p <= 0.05
    # slower on the point estimate: reverted at the first look, not measured on
    v = g.judge(before, _windows([128.0, 131.0, 135.0]))
    assert (v.keep, v.more) == (False, False)
    # faster, but by less than min_gain on the point estimate: measured on all the same
    # (in 3 noisy windows a real gain of min_gain or more can show as less)
    v = g.judge(before, _windows([136.0, 139.0, 141.0]))
    assert (v.keep, v.more) == (False, True)
    # still short of it at max_windows: reverted
    v = g.judge(before, _windows([152.3, 130.2, 156.1, 131.0, 150.5, 133.0]))
    assert (v.keep, v.more) == (False, False)
    # p = 0.08 passes a single look at 90 %, not one of two looks
    a, b = [148.0, 136.0, 160.0], [128.0, 133.0, 138.0]
    assert 0.05 < welch_greater(a, b).p <= 0.1
    assert Guard().judge(_windows(b), _windows(a)).keep
    assert Guard(max_windows=6).judge(_windows(b), _windows(a)).more
    with pytest.raises(ValueError, match="max_windows: 3 is invalid"):
        Guard(max_windows=3)


@pytest.mark.parametrize("seed", range(5))
def test_an_equal_change_measured_longer_is_still_not_kept(seed):
    ctl, events, workers = run(NoisyJob(1.0, seed=seed), 400, guard=Guard(max_windows=6))
    assert kinds(events) == ["tuning_proposed", "tuning_reverted"]
    rev = [e for e in events if e["event"] == "tuning_reverted"][0]
    extended = [e for e in events if e["event"] == "tuning_extended"]
    assert len(rev["after"]["window_rates"]) == (6 if extended else 3)
    assert workers[-1] == 0


def test_select_by_mean_keeps_an_undecided_faster_trial_at_the_second_look():
    before = _windows([131.8, 133.1, 138.4])
    # 5.8 % faster over 6 windows, not shown at 90 % (one look of two at p <= 0.05)
    after = _windows([152.3, 130.2, 156.1, 131.0, 150.5, 133.0])
    assert welch_greater(list(after.window_rates),
                         [1.02 * r for r in before.window_rates]).p > 0.05
    assert not Guard(min_gain=0.02, max_windows=6).judge(before, after).keep
    v = Guard(min_gain=0.02, max_windows=6, select_by_mean=True).judge(before, after)
    assert v.keep and "selected" in v.reason
    # faster on the mean, but not by min_gain: reverted all the same
    v = Guard(min_gain=0.08, max_windows=6, select_by_mean=True).judge(before, after)
    assert not v.keep and not v.more
    # the first look still measures on rather than selecting
    v = Guard(min_gain=0.02, max_windows=6, select_by_mean=True).judge(
        before, _windows([152.3, 130.2, 156.1]))
    assert v.more and not v.keep
    with pytest.raises(ValueError, match="select_by_mean: True is invalid"):
        Guard(select_by_mean=True)


def _keep_rate(speed: float, guard: Guard, seeds: int = 60) -> float:
    kept = 0
    for seed in range(seeds):
        _, events, workers = run(NoisyJob(speed, seed=seed), 400, guard=guard)
        k = kinds(events)
        assert k in (["tuning_proposed", "tuning_accepted"],
                     ["tuning_proposed", "tuning_reverted"]), k  # decided once, no flip-flop
        kept += k[-1] == "tuning_accepted"
        assert workers[-1] == (1 if k[-1] == "tuning_accepted" else 0)
    return kept / seeds


def test_select_by_mean_trades_false_keeps_for_the_small_gains_the_test_misses():
    """The rates docs/tuning.md quotes, over 60 seeds of the 3x-noise job (10-step
    windows, 3 per configuration, up to 6 for a trial, min_gain 2 %): selection keeps
    most 10 %-faster changes the test reverts, two in five of the changes that gain
    nothing (which cost nothing), and almost no 10 %-slower one."""
    test = Guard(min_gain=0.02, max_windows=6)
    select = Guard(min_gain=0.02, max_windows=6, select_by_mean=True)
    faster_test, faster_select = _keep_rate(1.1, test), _keep_rate(1.1, select)
    assert faster_test <= 0.4 and faster_select >= 0.8
    assert _keep_rate(1.0, test) <= 0.05 and 0.15 <= _keep_rate(1.0, select) <= 0.5
    assert _keep_rate(0.9, select) <= 0.05
