"""The guard: a change is kept only when it earned its gain, at a stated confidence.

Each configuration is measured over ``windows`` windows (``tuning.guard.windows``;
every window is samples over wall time, see :mod:`dlrover_core.tuning.metrics`).
After a trial, the guard compares the trial's window rates ``a`` with the window
rates ``b`` of the configuration before it by a one-sided Welch's t-test of
``mean(a) > (1 + min_gain) * mean(b)``:

    t  = (mean(a) - mean(b')) / sqrt(s_a^2/n_a + s_b'^2/n_b)
    df = (s_a^2/n_a + s_b'^2/n_b)^2 / ((s_a^2/n_a)^2/(n_a-1) + (s_b'^2/n_b)^2/(n_b-1))

with ``b' = (1 + min_gain) * b`` and ``s^2`` the sample variances (Welch, "The
generalization of Student's problem when several different population variances are
involved", Biometrika 34, 1947; the degrees of freedom are Satterthwaite's, 1946).
The change is kept when the p-value ``P(T_df >= t)`` is at most ``1 - confidence``;
otherwise (no gain shown: slower, or as fast within the noise) it is reverted. A
change whose memory peak crossed the limit (``memory_limit_bytes``, or, when that is
0, the smallest capacity a rank reported minus ``memory_headroom`` of it) is reverted
whatever its speed.

With ``max_windows`` set, a trial that is faster on the point estimate (its mean window
rate above the baseline's, by any margin) but not shown at the confidence is not
reverted at once: it is measured until it has ``max_windows``
windows and tested again (against the same baseline). Two looks at the data would
double the chance of keeping a change that gains nothing, so each look tests at half
the level, ``p <= (1 - confidence) / 2`` (Bonferroni's correction for two tests, a
bound on the chance of a false keep over both looks; Pocock's group-sequential design,
"Group sequential methods in the design and analysis of clinical trials", Biometrika
64, 1977, also tests every look at one level, slightly above this one because the
looks share data).

With ``select_by_mean`` also set, the second look ends the trial the way a selection
procedure does when its samples are spent: a trial still undecided at ``max_windows``
windows is kept when its mean window rate is above ``(1 + min_gain)`` times the
baseline's, that is when it was the faster of the two on the point estimate at both
looks (selection of the larger sample mean: Bechhofer, "A single-sample multiple
decision procedure for ranking means of normal populations with known variances",
Ann. Math. Statist. 25, 1954). This trades the bound on false keeps for throughput:
between two configurations whose difference the windows cannot show, picking the one
measured faster costs their difference only when it is the wrong one, and a difference
the windows cannot show is a small one, while reverting every such trial gives up the
small gains the noise hides. ``tests/test_tuning_guard.py`` measures both
rates: how often an equal change, a 10 % slower one and a 10 % faster one are kept.

The test itself is scipy's (``scipy.stats.ttest_ind``, ``equal_var=False``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from dlrover_core.spec.fields import check_fields
from dlrover_core.spec.schema import TuningGuardSpec
from dlrover_core.tuning.tuner import WindowSummary


@dataclass(frozen=True)
class WelchResult:
    """``t``: the statistic; ``df``: Welch-Satterthwaite degrees of freedom (``inf``
    when both samples have no spread); ``p``: one-sided p-value of ``mean(a) >
    mean(b)``."""

    t: float
    df: float
    p: float


def welch_greater(a: list[float], b: list[float]) -> WelchResult:
    """One-sided Welch's t-test of ``mean(a) > mean(b)``: ``scipy.stats.ttest_ind``
    with ``equal_var=False, alternative="greater"`` (formulas in the module docstring).
    Samples without spread give ``t = +-inf`` (or 0 when the means are equal) and
    ``p`` 0, 1 (or 0.5), where scipy would answer ``nan``.

    Raises:
        ValueError: a sample with fewer than 2 values.
    """
    from scipy.stats import ttest_ind

    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Welch's t-test needs >= 2 values per sample, got {len(a)} and "
                         f"{len(b)}; allowed: tuning.guard.windows >= 2")
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    if statistics.variance(a) + statistics.variance(b) <= 0.0:
        if ma == mb:
            return WelchResult(0.0, math.inf, 0.5)
        return WelchResult(math.copysign(math.inf, ma - mb), math.inf, 0.0 if ma > mb else 1.0)
    res = ttest_ind(list(a), list(b), equal_var=False, alternative="greater")
    return WelchResult(float(res.statistic), float(res.df), float(res.pvalue))


@dataclass(frozen=True)
class GuardVerdict:
    """``keep``: the trial earned its gain; ``more``: undecided, measure it up to
    ``max_windows`` windows and judge again; ``reason``: the figures, for the event."""

    keep: bool
    reason: str
    more: bool = False


@dataclass
class Guard(TuningGuardSpec):
    """The guard of ``tuning.guard``, with the fields (and their checks) of
    :class:`~dlrover_core.spec.schema.TuningGuardSpec`: ``confidence``: the confidence
    (0.5..1) at which a trial must be faster to be kept; ``min_gain``: the relative gain
    it must show (0.0: any gain); ``windows``: windows measured per configuration (>= 2);
    ``max_windows``: windows of a trial at its second look (0: one look; else >
    ``windows``); ``select_by_mean``: at the second look, keep a trial undecided by the
    test when its mean rate is above the bar (see the module docstring; needs
    ``max_windows``); ``max_retries``: how often a reverted change may be tried again;
    ``retry_shift``: how far the conditions must have moved since its revert before that
    (relative change of the baseline's samples/s, or absolute change of its data-wait
    share); ``memory_limit_bytes``: per-rank memory limit, bytes (0: from the reported
    capacity); ``memory_headroom``: fraction of the capacity kept free when the limit
    comes from it.

    Raises:
        SpecError: (a ``ValueError``) a field out of its range, keyed ``tuning.guard.<field>``.
    """

    def __post_init__(self) -> None:
        check_fields(self, TuningGuardSpec, "tuning.guard")

    def memory_limit(self, window: WindowSummary) -> float:
        """The limit in bytes for ``window`` (0: none known)."""
        if self.memory_limit_bytes > 0:
            return float(self.memory_limit_bytes)
        if window.memory_capacity_bytes > 0:
            return window.memory_capacity_bytes * (1.0 - self.memory_headroom)
        return 0.0

    def windows_to_judge(self, trial: bool, measured: int) -> int:
        """Windows to measure before the next verdict: ``windows``, or for a trial the
        first look left undecided (it holds more) ``max_windows``."""
        return self.max_windows if trial and measured > self.windows else self.windows

    def judge(self, before: WindowSummary, after: WindowSummary) -> GuardVerdict:
        """Keep ``after`` (the trial's windows) over ``before`` (the windows of the
        config before it), revert it, or (``more``) measure it further? See the module
        docstring.

        Raises:
            ValueError: either summary has fewer than 2 window rates.
        """
        limit = self.memory_limit(after)
        if limit and after.memory_bytes > limit:
            return GuardVerdict(False, f"memory peak {after.memory_bytes / 2**20:.0f} MiB "
                                       f"crossed the limit {limit / 2**20:.0f} MiB")
        bar = 1.0 + self.min_gain
        res = welch_greater(list(after.window_rates), [r * bar for r in before.window_rates])
        figures = (f"{before.samples_per_s:.1f} -> {after.samples_per_s:.1f} samples/s "
                   f"({len(before.window_rates)} and {len(after.window_rates)} windows; "
                   f"Welch t={res.t:.2f}, df={res.df:.1f}, one-sided p={res.p:.3f})")
        gain = f"a gain over {self.min_gain:.0%}" if self.min_gain else "a gain"
        two_looks = self.max_windows > self.windows
        level = (1.0 - self.confidence) / (2 if two_looks else 1)
        if res.p <= level:
            return GuardVerdict(True, f"{gain} at {self.confidence:.0%} confidence: {figures}")
        mean_after = statistics.fmean(after.window_rates)
        mean_before = statistics.fmean(before.window_rates)
        if two_looks and len(after.window_rates) < self.max_windows and \
                mean_after > mean_before:
            return GuardVerdict(False, f"{gain} not yet shown at {self.confidence:.0%} "
                                       f"confidence: {figures}", more=True)
        if self.select_by_mean and two_looks and mean_after > bar * mean_before:
            return GuardVerdict(True, f"{gain} not shown at {self.confidence:.0%} "
                                      f"confidence, the faster on the mean at both looks "
                                      f"(selected): {figures}")
        return GuardVerdict(False, f"no {gain[2:]} shown at {self.confidence:.0%} "
                                   f"confidence: {figures}")

    def conditions_changed(self, then: WindowSummary, now: WindowSummary) -> bool:
        """Have the conditions moved since ``then`` (the baseline when a change was
        reverted) enough to try the change again? ``now`` is the current baseline."""
        if then.samples_per_s > 0 and \
                abs(now.samples_per_s / then.samples_per_s - 1.0) > self.retry_shift:
            return True
        return abs(now.data_wait_share - then.data_wait_share) > self.retry_shift
