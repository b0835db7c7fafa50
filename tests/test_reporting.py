"""StepReporter: rank 0 sends every report; other ranks coalesce to one send per
interval, and their newest step always arrives (no Ray needed: ``send`` is a list)."""

from __future__ import annotations

import threading
import time

import pytest

from dlrover_core.runtime.reporting import (MAX_INTERVAL_S, MIN_INTERVAL_S, StepReporter,
                                            report_interval_s)


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[int, dict, float]] = []
        self.lock = threading.Lock()

    def __call__(self, step, metrics, ts):
        with self.lock:
            self.sent.append((step, metrics, ts))
            return f"ref-{step}"  # what master.report.remote returns: a handle to wait on


def test_rank0_sends_every_report():
    sink = Sink()
    r = StepReporter(sink, rank=0, interval_s=5.0)
    for s in range(20):
        r.report(s, {"loss": float(s)}, ts=100.0 + s)
    assert [x[0] for x in sink.sent] == list(range(20))
    assert sink.sent[7] == (7, {"loss": 7.0}, 107.0)


def test_other_ranks_coalesce_and_the_last_step_arrives():
    sink = Sink()
    r = StepReporter(sink, rank=3, interval_s=0.3)
    for s in range(200):  # 200 steps in about 0.4 s
        r.report(s, {}, ts=1000.0 + s)
        time.sleep(0.002)
    sent_during = len(sink.sent)
    assert 1 <= sent_during <= 4  # the first at once, then about one per 0.3 s
    deadline = time.time() + 5
    while sink.sent[-1][0] != 199:  # the newest step follows within an interval
        assert time.time() < deadline, sink.sent
        time.sleep(0.05)
    assert sink.sent[-1] == (199, {}, 1199.0)  # with the time the step ended
    n = len(sink.sent)
    time.sleep(0.8)
    assert len(sink.sent) == n  # nothing new: nothing sent
    r.close()


def test_close_flushes_the_pending_step():
    sink = Sink()
    r = StepReporter(sink, rank=1, interval_s=60.0)
    r.report(0, {}, ts=1.0)
    r.report(1, {}, ts=2.0)
    assert [x[0] for x in sink.sent] == [0]
    assert r.last_sent == "ref-0"
    r.close()
    assert [x[0] for x in sink.sent] == [0, 1]
    assert r.last_sent == "ref-1"  # the host waits on it before its run returns
    r.close()  # idempotent
    assert len(sink.sent) == 2


def test_interval_grows_with_world_size_and_respects_hang_timeout():
    assert report_interval_s(2) == MIN_INTERVAL_S
    assert report_interval_s(500) == pytest.approx(5.0)
    assert report_interval_s(100_000) == MAX_INTERVAL_S
    assert report_interval_s(500, hang_timeout_s=8) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="world_size=0 is invalid; allowed: >= 1"):
        report_interval_s(0)
    with pytest.raises(ValueError, match="hang_timeout_s=-1 is invalid"):
        report_interval_s(4, -1)
