"""TensorBoard scalars from a job's records, read back with TensorBoard's own reader."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorboard")

from dlrover_core.observability.tensorboard import TensorBoardSink, tensorboard_dir  # noqa: E402


def scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6), e.wall_time) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def test_records_become_scalars(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "summary.json").write_text(json.dumps({"goodput": 0.875}))
    sink = TensorBoardSink(str(tmp_path / "tb"), job_dir=str(job_dir))
    T = 1_700_000_000.0
    for s in range(3):
        sink.on_record({"ts": T + s, "event": "step", "role": "trainer", "step": s,
                        "loss": 2.0 - s, "samples_per_s": 100.0 + s, "note": "text",
                        "nan": float("nan")})
    sink.on_record({"ts": T + 3, "event": "checkpoint_saved", "step": 2, "blocking_s": 0.25})
    sink.on_record({"ts": T + 4, "event": "failure_classified", "level": "process"})
    sink.on_record({"ts": T + 6, "event": "recovery_finished", "seconds": 1.5,
                    "steps_lost": 1})
    sink.on_record({"ts": T + 7, "event": "tuning_applied", "version": 2, "step": 2})
    sink.on_record({"ts": T + 9, "event": "job_finished", "status": "succeeded",
                    "wall_s": 9.0})
    sink.close()
    got = scalars(str(tmp_path / "tb"))
    assert [(s, v) for s, v, _ in got["trainer/loss"]] == [(0, 2.0), (1, 1.0), (2, 0.0)]
    assert [v for _, v, _ in got["trainer/samples_per_s"]] == [100.0, 101.0, 102.0]
    assert got["trainer/loss"][1][2] == pytest.approx(T + 1)  # the record's time
    assert "trainer/note" not in got and "trainer/nan" not in got
    assert [(s, v) for s, v, _ in got["job/checkpoint_s"]] == [(2, 0.25)]
    assert [(s, v) for s, v, _ in got["job/restarts"]] == [(2, 1.0)]
    assert [(s, v) for s, v, _ in got["job/recovery_s"]] == [(2, 1.5)]
    assert [(s, v) for s, v, _ in got["job/steps_lost"]] == [(2, 1.0)]
    assert [(s, v) for s, v, _ in got["job/tuning_version"]] == [(2, 2.0)]
    assert [(s, v) for s, v, _ in got["job/goodput"]] == [(2, 0.875)]
    assert [(s, v) for s, v, _ in got["job/wall_s"]] == [(2, 9.0)]


def test_where_the_files_go(tmp_path):
    job_dir = str(tmp_path / "runs" / "nanogpt")
    assert tensorboard_dir(True, job_dir, "nanogpt") == f"{job_dir}/tensorboard"
    assert tensorboard_dir(False, job_dir, "nanogpt") is None
    assert tensorboard_dir("/abs/tb", job_dir, "nanogpt") == "/abs/tb/nanogpt"
    assert tensorboard_dir("tb", job_dir, "nanogpt") == str(tmp_path / "runs" / "tb" / "nanogpt")
    with pytest.raises(ValueError, match="observability.tensorboard: 3 is invalid"):
        tensorboard_dir(3, job_dir, "nanogpt")


def test_spec_section_is_checked_before_anything_starts():
    from dlrover_core import SpecError, load_spec

    base = {"name": "t", "roles": {"trainer": {"workload": "a.b:C"}}}
    assert load_spec(base).observability.tensorboard is False
    assert load_spec({**base, "observability": {"tensorboard": True}}).observability.tensorboard
    assert load_spec({**base, "observability": {"tensorboard": "tb"}}).observability.tensorboard \
        == "tb"
    for bad in (3, "", " "):
        with pytest.raises(SpecError, match="observability.tensorboard: .* is invalid; "
                                            "allowed: true"):
            load_spec({**base, "observability": {"tensorboard": bad}})
    with pytest.raises(SpecError, match="observability.tensorbord: .*unknown key.*tensorboard"):
        load_spec({**base, "observability": {"tensorbord": True}})
