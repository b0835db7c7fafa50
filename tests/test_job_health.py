"""The JobMaster's health watch (dlrover_core.master.health): a real plugin manager with
a real plugin answering ``dlrover_job_health`` from a file the test writes, polled by
the watch's own thread; events and ``current()`` follow the answers."""

from __future__ import annotations

import json
import os
import time

import pytest

from dlrover_core import hookimpl
from dlrover_core.master.health import HealthWatch
from dlrover_core.plugins.manager import PluginManager


class FilePlugin:
    """Answers ``dlrover_job_health`` with the JSON in ``path`` (``{}`` when missing);
    raises when the file says ``"raise"``."""

    def __init__(self, path: str) -> None:
        self.path = path

    @hookimpl
    def dlrover_job_health(self, job, spec):
        try:
            with open(self.path) as f:
                got = json.load(f)
        except FileNotFoundError:
            return None
        if got == "raise":
            raise RuntimeError("the plugin's own bug")
        return got


def wait_for(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


def test_a_failing_check_shows_and_recovers_with_events(tmp_path):
    path = str(tmp_path / "answer.json")
    pm = PluginManager(load_entry_points=False)
    pm.register(FilePlugin(path), "health-file")
    events: list[tuple[str, dict]] = []
    watch = HealthWatch(pm, "job1", None, lambda e, **f: events.append((e, f)),
                        interval_s=0.05)
    watch.start()
    try:
        time.sleep(0.3)
        assert watch.current() == {} and events == []
        with open(path, "w") as f:
            json.dump({"disk": {"n1": {"what": "persisting step 4", "error": "ENOSPC"}}}, f)
        wait_for(lambda: watch.current())
        assert watch.current() == {"disk": {"n1": {"what": "persisting step 4",
                                                   "error": "ENOSPC"}}}
        with open(path, "w") as f:
            json.dump("raise", f)  # a plugin's bug: the last answer stands, no event
        time.sleep(0.3)
        assert [e for e, _ in events] == ["health_failing"]
        assert watch.current()["disk"]["n1"]["error"] == "ENOSPC"
        os.unlink(path)
        wait_for(lambda: not watch.current())
    finally:
        watch.stop()
    assert [e for e, _ in events] == ["health_failing", "health_recovered"]
    assert events[0][1] == {"check": "disk", "details": {
        "n1": {"what": "persisting step 4", "error": "ENOSPC"}}}
    assert events[1][1]["check"] == "disk" and events[1][1]["failed_s"] >= 0.2


def test_two_plugins_answers_are_merged(tmp_path):
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    for path, check in ((a, "x"), (b, "y")):
        with open(path, "w") as f:
            json.dump({check: {"error": check}}, f)
    pm = PluginManager(load_entry_points=False)
    pm.register(FilePlugin(a), "health-a")
    pm.register(FilePlugin(b), "health-b")
    assert HealthWatch(pm, "j", None, lambda e, **f: None).poll() == {
        "x": {"error": "x"}, "y": {"error": "y"}}


def test_bad_interval_names_the_value():
    with pytest.raises(ValueError, match="interval_s 0"):
        HealthWatch(PluginManager(load_entry_points=False), "j", None, print, interval_s=0)


def test_status_line_says_what_fails():
    from dlrover_core.cli.job_control import status_line

    st = {"name": "n", "run": 1, "state": "running", "step": 5, "elapsed_s": 3,
          "restarts": {}, "health": {"checkpoint_persist": {"node1": {
              "what": "persisting trainer step 4", "error": "[Errno 28] No space left"}}}}
    assert status_line(st).endswith(
        "; checkpoint_persist failing (persisting trainer step 4: [Errno 28] No space left)")
    assert "failing" not in status_line({**st, "health": {}})
