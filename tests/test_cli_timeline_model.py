"""The timeline's data from a hand-written job directory (exact numbers), and what
the figure draws of it, read back from the PNG's pixels."""

from __future__ import annotations

import json

import pytest

from dlrover_core.cli.job_files import JobFiles, resolve_job_dir
from dlrover_core.cli.timeline_model import build_timeline

T0 = 1_700_000_000.0


def write_job(d, events, steps, summary=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "events.jsonl").write_text("".join(json.dumps({"ts": T0 + t, "event": e, **f}) + "\n"
                                            for t, e, f in events))
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"ts": T0 + t, "event": "step", "role": "trainer", "step": s, "loss": 1.0})
        + "\n" for t, s in steps))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    return str(d)


EVENTS = [
    (0.0, "job_started", {"job": "toy", "roles": {"trainer": {"total": 2}}}),
    (2.0, "instance_started", {"role": "trainer", "rank": 0, "attempt": 0}),
    (2.0, "instance_started", {"role": "trainer", "rank": 1, "attempt": 0}),
    (6.0, "checkpoint_saved", {"role": "trainer", "step": 3, "blocking_s": 0.5}),
    (9.0, "instance_failed", {"role": "trainer", "rank": 1, "kind": "actor_died", "step": 6,
                              "message": "SIGKILL"}),
    (9.0, "failure_classified", {"role": "trainer", "rank": 1, "level": "process"}),
    (9.5, "recovery_started", {"level": "process"}),
    (11.5, "instance_started", {"role": "trainer", "rank": 0, "attempt": 1}),
    (11.5, "instance_started", {"role": "trainer", "rank": 1, "attempt": 1}),
    (11.5, "recovery_finished", {"level": "process", "seconds": 2.0}),
    (14.0, "tuning_applied", {"version": 1, "step": 9}),
    (20.0, "instance_finished", {"role": "trainer", "rank": 0, "step": 15}),
    (20.0, "instance_finished", {"role": "trainer", "rank": 1, "step": 15}),
    (20.0, "job_finished", {"status": "succeeded"}),
]
# steps 0..6 every second from t=3, then (after the restart from step 4) 4..15 from 12
STEPS = [(3.0 + i, i) for i in range(7)] + [(12.0 + 0.5 * i, 4 + i) for i in range(12)]


@pytest.fixture
def toy(tmp_path):
    return write_job(tmp_path / "toy", EVENTS, STEPS,
                     {"name": "toy", "status": "succeeded", "goodput": 0.5, "wall_s": 20.0})


def test_rows_failures_recoveries(toy):
    tl = build_timeline(JobFiles.read(toy))
    assert (tl.name, tl.status, tl.wall_s) == ("toy", "succeeded", 20.0)
    assert [r.label for r in tl.rows] == ["trainer-0", "trainer-1"]
    r1 = tl.rows[1].attempts
    assert [(a.start, a.end, a.attempt, a.outcome) for a in r1] == [
        (2.0, 9.0, 0, "failed"), (11.5, 20.0, 1, "finished")]
    r0 = tl.rows[0].attempts  # restarted in place by the recovery, no failure of its own
    assert [(a.start, a.end, a.outcome) for a in r0] == [(2.0, 11.5, "restarted"),
                                                          (11.5, 20.0, "finished")]
    (f,) = tl.failures
    assert (f.t, f.role, f.rank, f.kind, f.level, f.step) == (9.0, "trainer", 1, "actor_died",
                                                               "process", 6)
    (rec,) = tl.recoveries
    assert (rec.start, rec.end, rec.level, rec.seconds) == (9.5, 11.5, "process", 2.0)
    assert [(c.t, c.step, c.blocking_s) for c in tl.checkpoints] == [(6.0, 3, 0.5)]
    assert [(m.t, m.version, m.event) for m in tl.tuning] == [(14.0, 1, "applied")]
    assert tl.steps[0] == (3.0, 0) and tl.steps[-1] == (17.5, 15)


def test_goodput_breakdown_sums_to_wall_time(toy):
    tl = build_timeline(JobFiles.read(toy))
    b = tl.breakdown
    assert b["startup"] == 3.0  # job start to the first step
    assert b["recovery"] == 2.0
    assert b["checkpoint"] == 0.5
    assert b["productive"] == 10.0  # goodput 0.5 x 20 s
    assert b["other"] == pytest.approx(20.0 - 3.0 - 2.0 - 0.5 - 10.0)
    assert sum(b.values()) == pytest.approx(tl.wall_s)


def test_running_job_without_summary(tmp_path):
    d = write_job(tmp_path / "live", EVENTS[:6], STEPS[:7])
    tl = build_timeline(JobFiles.read(d))
    assert tl.status == "running"
    assert tl.wall_s == 9.0  # up to the newest event or step
    assert tl.rows[0].attempts[-1].outcome == "running"
    assert tl.goodput is not None  # from the steps: 7 unique x 1 s median / 9 s
    assert tl.goodput == pytest.approx(7 / 9)


def test_resolve_job_dir(toy, tmp_path, monkeypatch):
    assert resolve_job_dir(toy) == toy
    monkeypatch.chdir(tmp_path)
    assert resolve_job_dir("toy", root=str(tmp_path)) == toy
    with pytest.raises(FileNotFoundError, match="job 'nope': no job directory"):
        resolve_job_dir("nope")


def pixel(img, ax, x, y):
    """RGB (0..255) of the PNG at data point (x, y) of ``ax``."""
    px, py = ax.transData.transform((x, y))
    h = img.shape[0]
    r, g, b = img[int(round(h - py)), int(round(px)), :3]
    return tuple(int(round(255 * v)) for v in (r, g, b))


def rgb(hex_color):
    return tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))


def close(a, b, tol=12):
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def test_png_shows_the_drawn_data(toy, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from dlrover_core.cli import timeline_plot as tp

    tl = build_timeline(JobFiles.read(toy))
    out = tmp_path / "t.png"
    fig, axes = tp.save_timeline(tl, str(out))
    img = imread(str(out))
    assert img.shape[0] == int(fig.get_figheight() * fig.dpi)
    rows, good = axes["rows"], axes["goodput"]
    # the failure marker where rank 1 failed; no marker on rank 0's row at that time
    assert close(pixel(img, rows, 9.0, 1), rgb(tp.FAILURE_COLOR))
    assert not close(pixel(img, rows, 9.0, 0), rgb(tp.FAILURE_COLOR))
    # rank 1's attempts: the first colour before the failure, the second after recovery
    assert close(pixel(img, rows, 5.0, 1), rgb(tp.ATTEMPT_COLORS[0]))
    assert close(pixel(img, rows, 16.0, 1), rgb(tp.ATTEMPT_COLORS[1]))
    # the checkpoint band (t 5.5 .. 6.0) between the rows, the recovery band in the gap
    assert close(pixel(img, rows, 5.75, 0.5), rgb(tp.CHECKPOINT_COLOR), tol=30)
    level = pixel(img, rows, 10.5, 1)
    assert level != (255, 255, 255) and not close(level, rgb(tp.ATTEMPT_COLORS[0]))
    # goodput bar: each part drawn where the breakdown puts it
    left = 0.0
    for part in ("productive", "startup", "recovery", "checkpoint", "other"):
        w = tl.breakdown[part]
        if w > 0.4:
            probe = pixel(img, good, left + (w / 4 if part == "productive" else w / 2), 0.3)
            assert close(probe, rgb(tp.GOODPUT_COLORS[part])), (part, probe)
        left += w
