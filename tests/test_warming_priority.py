"""``low_priority`` / ``restore_priority`` (a standby's warm-up under ``SCHED_IDLE``)
on this process's real threads. Moving threads back needs ``CAP_SYS_NICE`` or a high
enough ``RLIMIT_NICE`` (root in CI); without either the tests that lower are skipped and
the last one checks that nothing is lowered."""

from __future__ import annotations

import os
import threading

import pytest

from dlrover_core.runtime import warming


def _policies() -> set[int]:
    return set(warming._policies().values())


@pytest.fixture
def fresh(monkeypatch):
    """Module state as in a new process (a test's restore_priority() must not stop the
    next test's lowering); this thread at nice 5, to see that nice values are kept."""
    monkeypatch.setattr(warming, "_hurried", False)
    monkeypatch.setattr(warming, "_lowered_from", None)
    if not warming._may_raise_priority(0):
        pytest.skip("this process may not raise its priority back (no CAP_SYS_NICE)")
    assert _policies() == {os.SCHED_OTHER}
    os.setpriority(os.PRIO_PROCESS, 0, 5)
    yield
    for tid in warming._thread_ids():
        try:   # (a cancelled timer's thread may end meanwhile)
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            pass
    os.setpriority(os.PRIO_PROCESS, 0, 0)


def _in_thread() -> tuple[int, int]:
    out = []
    t = threading.Thread(target=lambda: out.append(
        (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0))))
    t.start()
    t.join()
    return out[0]


def test_the_body_runs_under_sched_idle_and_every_thread_gets_its_policy_back(fresh):
    stop = threading.Event()
    idle = threading.Thread(target=stop.wait)   # a thread started before, as Ray's are
    idle.start()
    try:
        with warming.low_priority(max_s=None) as lowered:   # (no timer thread)
            assert lowered is True
            assert _policies() == {os.SCHED_IDLE}
            assert _in_thread() == (os.SCHED_IDLE, 5)   # new threads inherit it
        assert _policies() == {os.SCHED_OTHER}
        assert os.getpriority(os.PRIO_PROCESS, 0) == 5   # the nice value kept
        assert _in_thread() == (os.SCHED_OTHER, 5)
    finally:
        stop.set()
        idle.join()


def test_restore_priority_during_the_body_raises_it_at_once_and_for_good(fresh):
    with warming.low_priority():
        assert warming.restore_priority() is True
        assert _policies() == {os.SCHED_OTHER}
        with warming.low_priority() as again:   # a later warm-up step lowers nothing
            assert again is False
            assert _policies() == {os.SCHED_OTHER}
    assert _policies() == {os.SCHED_OTHER}
    assert warming.restore_priority() is False   # nothing lowered any more


def test_nothing_is_lowered_where_the_priority_could_not_be_raised_back(monkeypatch):
    monkeypatch.setattr(warming, "_hurried", False)
    monkeypatch.setattr(warming, "_lowered_from", None)
    monkeypatch.setattr(warming, "_may_raise_priority", lambda to_nice: False)
    with warming.low_priority() as lowered:
        assert lowered is False
        assert _policies() == {os.SCHED_OTHER}


def test_a_body_that_runs_longer_than_max_s_gets_its_priority_back_then(fresh):
    """A node kept busy must not keep a standby cold for good: past ``max_s`` the
    timer thread (itself left at the normal priority) raises every thread back."""
    import time

    with warming.low_priority(max_s=0.3) as lowered:
        assert lowered is True
        assert _policies() == {os.SCHED_IDLE, os.SCHED_OTHER}   # the timer's thread
        deadline = time.monotonic() + 10
        while os.sched_getscheduler(0) == os.SCHED_IDLE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _policies() == {os.SCHED_OTHER}
        assert warming._hurried is True   # and lowers nothing more
