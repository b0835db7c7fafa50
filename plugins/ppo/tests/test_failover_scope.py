"""The failover decisions of a ppo job, without Ray: the failure record of a served role,
the classifier's setup rule, and the scope the graph gives each role's failure."""

from __future__ import annotations

import pytest

from dlrover_core import load_spec
from dlrover_core.builtin.failure import classify
from dlrover_core.graph.graph import ComputationGraph
from dlrover_core.master.failover import graph_scope, what_was_running
from dlrover_core.plugins.records import Failure, FailoverLevel
from dlrover_core.spec.errors import SpecError


@pytest.fixture
def graph():
    return ComputationGraph.from_spec(load_spec("examples/ppo_cartpole/job.yaml", []))


def test_a_served_role_that_dies_mid_run_is_in_phase_run_at_the_drivers_step(graph):
    # the master's guess from the rollout's own reports: it never reports a step
    died = Failure.actor_died("rollout", 1, "killed", phase="setup", step=-1)
    rec = what_was_running(died, set_up=True, graph=graph, driver_step=15)
    assert (rec.phase, rec.step) == ("run", 15)
    # not set up yet: it did die during setup
    early = what_was_running(died, set_up=False, graph=graph, driver_step=15)
    assert (early.phase, early.step) == ("setup", -1)


def test_setup_errors_are_fatal_only_when_they_happened_during_setup(graph):
    during = Failure.user_error("rollout", 0, "AttributeError", "no attribute 'x'",
                                phase="setup", step=-1)
    assert classify(during, []).level == "fatal"
    # the same error type raised in a driver call after 16 iterations: the worker says
    # phase run; the record gets the driver's step; a restart may fix it
    later = what_was_running(Failure.user_error("rollout", 0, "AttributeError", "x",
                                                phase="run", step=-1),
                             set_up=True, graph=graph, driver_step=16)
    assert later.step == 16
    assert classify(later, []).level == "process"


def test_the_graph_decides_the_scope_of_each_roles_failure(graph):
    level = FailoverLevel.PROCESS
    restart, scope = graph_scope(Failure.actor_died("rollout", 1, "x"), level,
                                 ["rollout"], graph)
    assert restart is False
    assert scope["restart"] == ["rollout-1"] and scope["rollback"] == []
    assert scope["retry"] == ["driver -> rollout"]
    restart, scope = graph_scope(Failure.actor_died("actor", 0, "x"), level, ["actor"], graph)
    assert restart is True
    assert scope["restart"] == ["actor-0", "driver"]
    assert set(scope["rollback"]) == {"driver", "actor", "critic"}
    # the critic's downstream (the actor) rolls back with it
    _, scope = graph_scope(Failure.actor_died("critic", 0, "x"), level, ["critic"], graph)
    assert {"critic", "actor"} <= set(scope["rollback"])
    restart, scope = graph_scope(Failure.actor_died("driver", 0, "x"), level, ["driver"],
                                 graph)
    assert restart is True and scope["restart"] == ["driver"]
    # node and job levels restart everything: no graph scope
    assert graph_scope(Failure.actor_died("rollout", 1, "x"), FailoverLevel.JOB, [],
                       graph) == (True, {})


def test_the_failover_policy_is_set_per_role_in_the_spec():
    spec = load_spec("examples/ppo_cartpole/job.yaml",
                     ["+roles.rollout.config.failover=rollback"])
    g = ComputationGraph.from_spec(spec)
    assert g.failover_policy("rollout") == "rollback"
    assert g.failover_policy("actor") == "rollback"
    restart, _ = graph_scope(Failure.actor_died("rollout", 0, "x"), FailoverLevel.PROCESS,
                             ["rollout"], g)
    assert restart is True
    with pytest.raises(SpecError, match=r"roles\.rollout\.config\.failover.*'retry'.*replace"):
        load_spec("examples/ppo_cartpole/job.yaml", ["+roles.rollout.config.failover=retry"])
