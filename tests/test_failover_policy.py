"""The failover policy without a cluster: which failures count toward a node's
``failover.max_node_failures`` (only node-attributable ones), with the real plugin
manager's classifiers. The alive nodes are given as a function (two nodes)."""

from __future__ import annotations

from omegaconf import OmegaConf

from dlrover_core.master.failover import FailoverCoordinator, node_attributable
from dlrover_core.plugins.records import Failure, FailureVerdict

NODES = {"node-a" + "0" * 50, "node-b" + "0" * 50}
A = sorted(NODES)[0]


def coordinator(plugin_manager, max_node_failures=2):
    cfg = OmegaConf.create({"max_restarts": 20, "max_node_failures": max_node_failures})
    return FailoverCoordinator(cfg, plugin_manager, alive_nodes=lambda: set(NODES))


def test_user_exceptions_on_a_healthy_node_do_not_mark_it_bad(plugin_manager):
    fc = coordinator(plugin_manager)
    for step in (3, 9, 15):  # three different Python exceptions on node A
        action = fc.decide(Failure.user_error("trainer", 1, "ValueError", f"bad batch {step}",
                                              node_id=A, step=step), graph=None)
        assert action.level == "process"
    assert fc.bad_nodes == set() and fc.node_failures == {}


def test_plain_process_deaths_do_not_count_but_node_causes_do(plugin_manager):
    fc = coordinator(plugin_manager)
    sigkill = "The actor died unexpectedly before finishing this task."
    for _ in range(3):
        assert fc.decide(Failure.actor_died("trainer", 0, sigkill, node_id=A),
                         graph=None).level == "process"
    assert fc.bad_nodes == set()
    node_dead = "The actor died because its node has died. Node Id: " + A
    first = fc.decide(Failure.actor_died("trainer", 0, node_dead, node_id=A), graph=None)
    assert first.level == "process" and fc.node_failures == {A: 1}
    second = fc.decide(Failure.actor_died("trainer", 1, node_dead, node_id=A), graph=None)
    assert second.level == "node" and fc.bad_nodes == {A}
    assert "2 failures on node" in second.verdict.reason


def test_node_attributable():
    user = Failure.user_error("t", 0, "RuntimeError", "x", node_id=A)
    oom = Failure.actor_died("t", 0, "Task was killed due to the node running low on memory.",
                             node_id=A)
    assert not node_attributable(user, FailureVerdict("process", "r"))
    assert node_attributable(user, FailureVerdict("node", "a plugin knows this error"))
    assert node_attributable(oom, FailureVerdict("process", "r"))
    assert node_attributable(Failure.node_lost("t", 0, A), FailureVerdict("node", "gone"))


def test_reasons_name_the_step_after_the_last_reported_one():
    """Issue 52 item 4: ``step`` is the last step the rank reported, so the user's code
    failed in the step after it; a reason said "at step 2" for an error during step 3."""
    from dlrover_core.builtin.failure import classify

    during_3 = Failure.user_error("trainer", 0, "ValueError", "bad", step=2)
    assert classify(during_3, []).reason == "ValueError in user code after step 2"
    first = Failure.user_error("trainer", 0, "ValueError", "bad", step=-1)
    assert classify(first, []).reason == "ValueError in user code before its first reported step"


def test_a_script_killed_by_a_signal_is_said_to_come_from_outside():
    """Issue 52 item 4: a script rank SIGKILLed from outside was 'ScriptExitError in user
    code'. The message is the one runtime/script.py raises."""
    from dlrover_core.builtin.failure import classify

    msg = ("trainer-1: script 'train.py' ended with signal SIGKILL (9); its last error: "
           "nothing")
    killed = Failure.user_error("trainer", 1, "dlrover_core.runtime.script.ScriptExitError",
                                msg, step=4)
    verdict = classify(killed, [])
    assert verdict.level == "process"
    assert verdict.reason == ("trainer-1's script was killed by SIGKILL after step 4, from "
                              "outside the job (another process, or the kernel's OOM killer): "
                              "not an error in its code")
    exited = Failure.user_error("trainer", 1, "dlrover_core.runtime.script.ScriptExitError",
                                "trainer-1: script 'train.py' ended with exit code 3", step=4)
    assert "in user code" in classify(exited, []).reason


def test_a_survivor_stopped_for_a_peer_s_failure_is_a_broken_collective():
    """A survivor's attempt the master stopped (``AttemptAborted``, raised where the rank
    computed) is what a survivor's failed all-reduce was: a process-level failure."""
    from dlrover_core.builtin.failure import classify, is_broken_collective

    stopped = Failure.user_error(
        "trainer", 0, "dlrover_core.runtime.attempt_stop.AttemptAborted",
        "a peer of this rank failed: this attempt stopped at a gradient of the backward "
        "pass (dlrover recovery in place)", step=20)
    assert is_broken_collective(stopped)
    verdict = classify(stopped, [])
    assert (verdict.level, verdict.reason[:18]) == ("process", "broken collective:")
    assert not is_broken_collective(Failure.user_error("trainer", 0, "ValueError", "bad"))
