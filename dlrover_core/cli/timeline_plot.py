"""Draw a :class:`~dlrover_core.cli.timeline_model.Timeline` with matplotlib (the
``timeline`` extra: ``pip install 'dlrover-core[timeline]'``).

Three panels over the job's wall time (seconds since ``job_started``):

1. the step rank 0 reported (a line), with tuning versions as vertical lines; a job
   of script roles only has steps when its scripts call
   ``dlrover_core.script_api.report_step``; without them the panel says so;
2. one row per role instance: a bar per attempt (shade by attempt number), a red
   ``X`` where it failed, a band per recovery coloured by its failover level (with its
   duration), and a thin band per checkpoint as long as the save blocked the loop; a
   script role's attempts are labelled at their end with how they ended
   (``Attempt.exit``: ``exit code 0``, ``signal SIGKILL (9)``, ``node_lost``, ...);
3. the goodput breakdown: one stacked bar (productive, start-up, recovery,
   checkpoint, other), each part labelled with its share of the wall time.

Colours are module constants so that tests can find what was drawn in the PNG.
"""

from __future__ import annotations

from typing import Any

from dlrover_core.cli.timeline_model import GOODPUT_PARTS, Timeline

FAILURE_COLOR = "#d62728"
CHECKPOINT_COLOR = "#ff7f0e"
TUNING_COLOR = "#9467bd"
STEP_COLOR = "#1f77b4"
ATTEMPT_COLORS = ("#2ca02c", "#98df8a", "#17becf", "#9edae5")
LEVEL_COLORS = {"process": "#ffbb78", "role": "#f7b6d2", "node": "#c5b0d5", "job": "#c49c94",
                "fatal": "#7f7f7f"}
GOODPUT_COLORS = {"productive": "#2ca02c", "startup": "#1f77b4", "recovery": "#d62728",
                  "checkpoint": "#ff7f0e", "other": "#c7c7c7"}
#: drawn at least this wide (s as a share of the wall time) so a 5 ms save shows
MIN_SPAN_SHARE = 0.002


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("dlrover timeline needs matplotlib: pip install "
                           "'dlrover-core[timeline]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_timeline(tl: Timeline, width_in: float = 12.0, dpi: int = 100) -> tuple[Any, dict]:
    """Draw ``tl``; returns ``(figure, axes)`` with ``axes`` keys ``steps``, ``rows``,
    ``goodput``. Save with ``figure.savefig(path, dpi=figure.dpi)`` so that data
    coordinates map to the PNG's pixels through ``ax.transData``."""
    plt = _matplotlib()
    n = max(1, len(tl.rows))
    fig, (ax_s, ax_r, ax_g) = plt.subplots(
        3, 1, figsize=(width_in, 2.2 + 0.45 * n + 1.3), dpi=dpi,
        gridspec_kw={"height_ratios": [2.2, max(1.0, 0.45 * n), 0.9]})
    wall = max(tl.wall_s, 1e-6)
    min_w = MIN_SPAN_SHARE * wall

    # 1. steps and tuning versions
    if tl.steps:
        ax_s.plot([t for t, _ in tl.steps], [s for _, s in tl.steps], color=STEP_COLOR, lw=1.5,
                  drawstyle="steps-post", label="step (rank 0)")
    for m in tl.tuning:
        ax_s.axvline(m.t, color=TUNING_COLOR, ls="-" if m.event == "applied" else ":", lw=1.2)
        ax_s.annotate(f"v{m.version}{' reverted' if m.event == 'reverted' else ''}",
                      (m.t, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                      va="top", ha="right", fontsize=7, color=TUNING_COLOR)
    if not tl.steps and tl.script_roles:
        ax_s.text(0.5, 0.5, f"no steps: script role(s) {', '.join(tl.script_roles)} report "
                  "none (a script reports with dlrover_core.script_api.report_step); their "
                  "attempts below are labelled with how each ended",
                  transform=ax_s.transAxes, ha="center", va="center", fontsize=9,
                  color="#555555")
    ax_s.set_ylabel("step")
    ax_s.set_title(f"{tl.name}: {tl.status}, {tl.wall_s:.1f} s"
                   + (f", goodput {tl.goodput:.2f}" if tl.goodput is not None else ""))

    # 2. role instances
    for rec in tl.recoveries:
        ax_r.axvspan(rec.start, max(rec.end, rec.start + min_w),
                     color=LEVEL_COLORS.get(rec.level, "#dbdb8d"), alpha=0.6, lw=0, zorder=1)
        ax_r.annotate(f"{rec.level} {rec.seconds:.1f} s", (rec.start, 1.0),
                      xycoords=("data", "axes fraction"), va="bottom", fontsize=7)
    for c in tl.checkpoints:
        ax_r.axvspan(c.t - max(c.blocking_s, min_w), c.t, color=CHECKPOINT_COLOR, alpha=0.9,
                     lw=0, zorder=2)
    for i, row in enumerate(tl.rows):
        for a in row.attempts:
            ax_r.broken_barh([(a.start, max(a.end - a.start, min_w))], (i - 0.3, 0.6),
                             facecolors=ATTEMPT_COLORS[a.attempt % len(ATTEMPT_COLORS)],
                             zorder=3)
            if row.role in tl.script_roles and a.exit:
                ax_r.annotate(a.exit, (a.end, i), xytext=(-2, 0), textcoords="offset points",
                              ha="right", va="center", fontsize=7, zorder=6)
    if tl.failures:
        ax_r.scatter([f.t for f in tl.failures],
                     [tl.row_index(f.role, f.rank) for f in tl.failures],
                     marker="X", s=160, color=FAILURE_COLOR, edgecolors="none", zorder=5)
    ax_r.set_yticks(range(len(tl.rows)), [r.label for r in tl.rows])
    ax_r.set_ylim(len(tl.rows) - 0.5, -0.5)
    ax_r.set_ylabel("instance")

    # 3. goodput breakdown
    left = 0.0
    for part in GOODPUT_PARTS:
        w = tl.breakdown.get(part, 0.0)
        ax_g.barh(0, w, left=left, color=GOODPUT_COLORS[part], height=0.8, lw=0)
        if w / wall > 0.08:
            ax_g.text(left + w / 2, 0, f"{part} {100 * w / wall:.0f}%", ha="center",
                      va="center", fontsize=8)
        left += w
    ax_g.set_yticks([0], ["goodput"])
    ax_g.set_title("goodput breakdown: the wall time stacked by what it was spent on (s)",
                   fontsize=9)
    ax_r.set_xlabel("wall time since job start (s)")
    for ax in (ax_s, ax_r, ax_g):
        ax.set_xlim(0, wall)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Line2D([], [], color=STEP_COLOR, label="step"),
               Line2D([], [], color=FAILURE_COLOR, marker="X", ls="", label="failure"),
               Patch(color=CHECKPOINT_COLOR, label="checkpoint (blocking)"),
               *[Patch(color=LEVEL_COLORS[lv], label=f"recovery: {lv}")
                 for lv in dict.fromkeys(r.level for r in tl.recoveries) if lv in LEVEL_COLORS],
               *([Line2D([], [], color=TUNING_COLOR, label="tuning version")]
                 if tl.tuning else [])]
    parts = [Patch(color=GOODPUT_COLORS[p], label=f"{p} {tl.breakdown.get(p, 0.0):.1f} s")
             for p in GOODPUT_PARTS]
    ax_g.legend(handles=parts, loc="upper center", bbox_to_anchor=(0.5, -0.35), fontsize=7,
                ncol=len(parts), frameon=False)
    fig.legend(handles=handles, loc="upper right", fontsize=7, ncol=len(handles))
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig, {"steps": ax_s, "rows": ax_r, "goodput": ax_g}


def save_timeline(tl: Timeline, path: str, **kwargs: Any) -> tuple[Any, dict]:
    """Draw ``tl`` and write it to ``path`` (PNG, SVG or PDF by the extension); returns
    what :func:`draw_timeline` returns (the figure stays open)."""
    fig, axes = draw_timeline(tl, **kwargs)
    fig.savefig(path, dpi=fig.dpi)
    return fig, axes
