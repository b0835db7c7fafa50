"""One reporter per node (dlrover_core.runtime.node_reporter), on a real local Ray
cluster with real jobs: the non-zero ranks' reports reach the master in batched calls of
their node's agent; a killed agent loses no live rank's steps (the ranks report
directly); a hung rank is still found and blamed by itself. The role env lowers
``DLROVER_NODE_REPORTER_MIN_WORLD`` to 2 so that 4 ranks use agents."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import ray

from dlrover_core import BaseWorkload, DLJobBuilder
from dlrover_core.master.client import create_master
from dlrover_core.master.events import read_events
from dlrover_core.runtime.context import MASTER_NAMESPACE
from dlrover_core.runtime.node_reporter import (
    MIN_WORLD_ENV,
    PUSH_TIMEOUT_S,
    NodeRelay,
    agent_name,
    get_agent,
    min_world,
    relay_stale_s,
)
from dlrover_core.runtime.reporting import StepReporter
from dlrover_core.testing import poll_status

RANKS = 4


class Stepper(BaseWorkload):
    """Reports ``steps`` steps, one per ``step_s``; rank ``hang_rank`` stops reporting
    (sleeps in its own code) after step ``hang_step``."""

    def run(self) -> None:
        cfg = self.config
        for step in range(int(cfg.steps)):
            time.sleep(float(cfg.step_s))
            self.report(step, loss=1.0 / (step + 1))
            if self.rank == int(cfg.get("hang_rank", -1)) and step == int(cfg.hang_step):
                time.sleep(3600)


class SilentAgent:
    """Holds an agent's name but answers no push (sleeps in each): an agent that is
    stuck, or still starting on a loaded machine."""

    def push(self, *args) -> float:
        time.sleep(600)
        return 0.0


def silent_agent(job: str) -> object:
    """A :class:`SilentAgent` under ``job``'s agent name on this node (ranks on this
    node then find it instead of creating theirs)."""
    node = ray.get_runtime_context().get_node_id()
    agent = ray.remote(SilentAgent).options(
        name=agent_name(job, node), namespace=MASTER_NAMESPACE, num_cpus=0).remote()
    ray.get(agent.__ray_ready__.remote())
    return agent


def start(name: str, job_dir: str, hang_timeout_s: float = 0, **config) -> object:
    job = (DLJobBuilder().name(name)
           .workload("trainer", "tests.test_node_reporter", "Stepper").total(RANKS)
           .per_node(RANKS).resource(cpu=0.1).env({MIN_WORLD_ENV: "2"}).config(config)
           .failover(hang_timeout_s=hang_timeout_s, max_restarts=0)
           .skip_node_check().build())
    master = create_master(job.spec, job_dir)
    ray.get(master.start.remote())
    return master


def calls(master) -> dict:
    return ray.get(master.__ray_call__.remote(
        lambda self: dict(self.controller.progress.calls)))


def last_steps(master) -> dict[int, int]:
    return ray.get(master.__ray_call__.remote(lambda self: {
        i.rank: i.last_step for i in self.controller.scope.instances.roles.values()
        if i.role == "trainer"}))


def run_hang_job(name: str, job_dir: str) -> dict:
    """Run a 4-rank job whose rank 2 hangs after step 5 (hang timeout 4 s), check that
    it failed with a hang blamed on rank 2, and return the master's report calls."""
    master = start(name, job_dir, steps=400, step_s=0.1, hang_rank=2, hang_step=5,
                   hang_timeout_s=4)
    summary = poll_status(master, lambda st: st["summary"], 180)["summary"]
    c = calls(master)
    ray.kill(master, no_restart=True)
    failed = [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
              if e["event"] == "instance_failed"]
    assert failed and failed[0]["kind"] == "hang", failed
    assert failed[0]["rank"] == 2, failed[0]["message"]
    assert summary["status"] == "failed"
    return c


def until(fn, timeout: float = 120.0, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not reached in {timeout} s")


def test_min_world_names_bad_values(monkeypatch):
    monkeypatch.setenv(MIN_WORLD_ENV, "zero")
    with pytest.raises(ValueError, match=f"{MIN_WORLD_ENV}='zero'.*integer >= 1"):
        min_world()
    monkeypatch.setenv(MIN_WORLD_ENV, "8")
    assert min_world() == 8


class FakeRelay:
    """A relay without Ray: ``pushed`` what it took; ``dead``: its agent failed."""

    def __init__(self) -> None:
        self.pushed: list[int] = []
        self.dead = False

    def push(self, step, metrics, ts) -> bool:
        if self.dead:
            return False
        self.pushed.append(step)
        return True

    def lost(self) -> bool:
        return self.dead


def test_step_reporter_routes_through_its_relay_and_falls_back():
    direct: list[int] = []
    relay = FakeRelay()
    r = StepReporter(lambda step, m, ts: direct.append(step), rank=3, interval_s=0.05,
                     relay=relay)
    r.report(0, {})
    until(lambda: relay.pushed == [0], 10, every=0.01)
    r.report(1, {})
    until(lambda: relay.pushed == [0, 1], 10, every=0.01)
    assert direct == []
    relay.dead = True  # the agent died: the same step goes directly, then the next ones
    until(lambda: direct == [1], 10, every=0.01)
    r.report(2, {})
    until(lambda: direct == [1, 2], 10, every=0.01)
    r.close()
    assert direct == [1, 2]  # the final flush does not repeat what went directly
    zero = StepReporter(lambda step, m, ts: direct.append(-step), rank=0, interval_s=5,
                        relay=FakeRelay())
    zero.report(7, {})
    assert direct[-1] == -7  # rank 0 never uses a relay


def test_flush_sends_directly_what_only_the_relay_got():
    direct: list[int] = []
    relay = FakeRelay()
    r = StepReporter(lambda step, m, ts: direct.append(step), rank=1, interval_s=60,
                     relay=relay)
    r.report(5, {})
    assert relay.pushed == [5] and direct == []
    r.flush()  # a run's end: the master gets the newest step itself
    assert direct == [5]
    r.close()
    assert direct == [5]


def test_a_relay_waits_on_its_agent_a_quarter_of_the_hang_timeout_at_most():
    assert relay_stale_s(0.5) == PUSH_TIMEOUT_S  # no hang timeout
    assert relay_stale_s(0.5, 4.0) == 1.0
    assert relay_stale_s(1.0, 3.0) == 2.0  # never below two intervals
    assert relay_stale_s(10.0, 1800.0) == PUSH_TIMEOUT_S


@pytest.mark.slow  # a few seconds of real agents (the fast lane is near its budget)
def test_a_relay_drops_an_agent_that_does_not_answer_or_cannot_forward(ray_cluster):
    """A real relay against (1) an agent that answers no push while the rank goes on
    pushing every 0.1 s: the oldest unanswered push bounds the wait, so it is dropped
    (before, each new push restarted the clock and a stuck agent was never dropped);
    (2) a real agent whose forwards cannot go through (its job has no master): its
    answers say so and it is dropped. A dropped agent makes ``push`` say False: the
    rank reports directly."""
    silent = silent_agent("nr-silent")
    relay = NodeRelay("nr-silent", "trainer", 1, interval_s=0.1, stale_s=1.0)
    t0 = time.time()
    assert relay.push(0, {}, t0)
    step = 0
    while not relay.lost():
        step += 1
        assert relay.push(step, {}, time.time())
        assert time.time() - t0 < 60, "a silent agent was never dropped"
        time.sleep(0.1)
    assert relay.dropped == "unanswered" and step >= 5  # not before stale_s
    assert relay.push(step + 1, {}, time.time()) is False
    ray.kill(silent, no_restart=True)

    agent = get_agent("nr-nomaster", 0.1)  # forwards every 0.1 s, to no master
    ray.get(agent.stats.remote())  # started
    relay = NodeRelay("nr-nomaster", "trainer", 1, interval_s=0.1, stale_s=2.0)
    assert relay.push(0, {}, time.time())
    until(lambda: relay.lost() or not relay.push(1, {}, time.time()), 60, every=0.1)
    assert relay.dropped == "lagging", relay.dropped
    assert ray.get(agent.stats.remote())["failed"] >= 1
    ray.kill(agent, no_restart=True)


def test_the_roster_names_each_rank_with_its_newest_step_and_whether_it_lives():
    """What a restarted master reads from an agent (no Ray: the agent's object)."""
    from dlrover_core.runtime.node_reporter import NodeReporter

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer exists: a dead rank's
    agent = NodeReporter("job", interval_s=3600, node_id="n1")
    assert agent.name == agent_name("job", "n1")

    def ident(pid: int, node: str) -> dict:
        return {"info": {"node_id": node, "ip": "10.0.0.1", "pid": pid},
                "actor_name": f"actor-{pid}", "handle": None}

    agent.push("trainer", 1, 4, {"loss": 0.5}, 1.0, ident(os.getpid(), "n1"))
    agent.push("trainer", 1, 6, {"loss": 0.4}, 2.0)  # later pushes carry no identity
    agent.push("trainer", 1, 5, {"loss": 0.45}, 1.5)  # out of order: not the newest
    agent.push("trainer", 2, 3, {}, 1.0, ident(gone.pid, "n1"))
    agent.push("trainer", 3, 3, {}, 1.0)  # never introduced itself: not listed
    agent.push("trainer", 5, 1, {}, 1.0, ident(os.getpid(), "n2"))
    roster = {e["rank"]: e for e in agent.roster("n1")}
    assert sorted(roster) == [1, 2]
    assert roster[1]["step"] == 6 and roster[1]["metrics"] == {"loss": 0.4}
    assert roster[1]["alive"] is True and roster[1]["actor_name"] == f"actor-{os.getpid()}"
    assert roster[2]["alive"] is False
    assert sorted(e["rank"] for e in agent.roster()) == [1, 2, 5]


@pytest.mark.slow  # a 4-rank job of about 12 s
def test_batched_and_a_killed_agent_loses_no_steps(ray_cluster, job_dir):
    steps = 60
    master = start("nr-batch", job_dir, steps=steps, step_s=0.2)
    node = poll_status(master, lambda st: st["state"] == "running", 120)
    # the non-zero ranks' reports come through the agent, in batches, none directly
    c = until(lambda: (lambda c: c if c.get("batch_entries", 0) >= 3 * (RANKS - 1)
                       else None)(calls(master)))
    assert c.get("report_rank_n", 0) == 0, c
    assert c["batch_entries"] > c["report_batch"], c  # several ranks per call
    node_id = node["instances"]["trainer-1"]["node_id"]
    agent = ray.get_actor(agent_name("nr-batch", node_id), namespace=MASTER_NAMESPACE)
    stats = ray.get(agent.stats.remote())
    assert stats["calls"] >= 1 and stats["entries"] >= 3 * (RANKS - 1), stats
    at_kill = last_steps(master)
    ray.kill(agent, no_restart=True)
    # the live ranks go on reaching the master (directly now) with the steps between
    # the kill and their last one (not only their final report), until their last step
    seen: dict[int, set] = {r: set() for r in range(1, RANKS)}

    def all_done() -> bool:
        now = last_steps(master)
        for r in seen:
            if at_kill[r] < now[r] < steps - 1:
                seen[r].add(now[r])
        return now == {r: steps - 1 for r in range(RANKS)}

    until(all_done, 180, every=0.1)
    assert all(seen.values()), (at_kill, seen)
    assert calls(master).get("report_rank_n", 0) > 0
    summary = poll_status(master, lambda st: st["summary"], 120)["summary"]
    ray.kill(master, no_restart=True)
    assert summary["status"] == "succeeded", summary["error"]


@pytest.mark.slow  # waits out a hang bound
def test_a_hung_rank_behind_an_agent_is_blamed(ray_cluster, job_dir):
    # the node's agent is up before the job (the ranks find it, as they would one
    # another rank made): one that a rank starts can take longer than the job lives
    # on a loaded machine, and the ranks then rightly report directly (the next test)
    agent = get_agent("nr-hang", 0.5)
    ray.get(agent.stats.remote())
    c = run_hang_job("nr-hang", job_dir)
    ray.kill(agent, no_restart=True)
    assert c.get("report_batch", 0) >= 1, c  # the ranks did report through the agent


@pytest.mark.slow  # waits out a hang bound
def test_a_hung_rank_behind_a_silent_agent_is_blamed(ray_cluster, job_dir):
    """The agent answers nothing (stuck, or still starting on a loaded machine, as
    in the CI run where rank 1 was blamed for rank 2's hang): the healthy ranks drop
    it within a quarter of the hang timeout and report directly, so only the hung
    rank goes silent and it alone is blamed."""
    silent = silent_agent("nr-silent-hang")
    c = run_hang_job("nr-silent-hang", job_dir)
    ray.kill(silent, no_restart=True)
    assert c.get("report_batch", 0) == 0 and c.get("report_rank_n", 0) >= 2, c


@pytest.mark.slow  # a master restart mid-run
def test_agents_report_to_a_restarted_master(ray_cluster, job_dir):
    # 60 s of steps: the ranks must still be running when the restarted master is
    # checked (a rank's final flush goes directly, and a master restart on a loaded
    # 2-core CI machine can take tens of seconds)
    steps = 300
    master = start("nr-restart", job_dir, steps=steps, step_s=0.2)
    until(lambda: calls(master).get("report_batch", 0) >= 1)
    # the agent that forwarded is known to the master, persisted for its successor
    agents = until(lambda: ray.get(master.__ray_call__.remote(
        lambda self: self.controller.scope.context.get("agents"))), 60)
    assert list(agents.values()) == [agent_name("nr-restart", next(iter(agents)))]
    old_pid = ray.get(master.__ray_call__.remote(lambda self: os.getpid()))
    ray.kill(master, no_restart=False)  # Ray restarts it; it re-attaches from SQLite

    def restarted() -> bool:  # a new master process, running the job again
        try:
            pid = ray.get(master.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
            return pid != old_pid and ray.get(master.status.remote())["state"] == "running"
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False  # restarting

    until(restarted, 120, every=0.5)
    # the new master (its counters start at 0) gets the non-zero ranks' steps from the
    # agents again, and none of them directly while the ranks run
    c = until(lambda: (lambda c: c if c.get("batch_entries", 0) >= 3 * (RANKS - 1)
                       else None)(calls(master)))
    assert c.get("report_rank_n", 0) == 0, c
    summary = poll_status(master, lambda st: st["summary"], 180)["summary"]
    ray.kill(master, no_restart=True)
    assert summary["status"] == "succeeded", summary["error"]
    reattached = [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
                  if e["event"] == "master_reattached"]
    assert reattached and len(reattached[0]["attached"]) == RANKS, reattached
    # ranks 1-3 from their agent's roster, rank 0 (it reports directly) by its own probe
    assert reattached[0]["from_agents"] == RANKS - 1, reattached
