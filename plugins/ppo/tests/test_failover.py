"""Failover of a whole PPO job (examples/ppo_cartpole, shortened) on the real local Ray
cluster: one process is SIGKILLed from outside mid-run (its pid as the master reports
it), and the run must end exactly where an unkilled run ends.

The CartPole job is deterministic (seeded, one torch thread per role, environments and
RNGs in the rollout's checkpointed state), so "exactly" is bit for bit: every
iteration's reported metrics (timings aside) and the final ones equal the unkilled
run's. Before the stateful roles were checkpointed, an actor kill restarted the policy
from its initial weights (``mean_return`` collapsed at the redone iteration) and a
rollout or driver kill counted the lost iteration's environment steps twice.
"""

from __future__ import annotations

import json
import os

import pytest

from dlrover_core.testing import run_killing

ITERATIONS = 10
KILL_AFTER = 4          # the kill comes once the driver reported this iteration
STEPS_PER_ITERATION = 2 * 8 * 128  # rollout ranks x environments x steps


def _rows(job_dir: str) -> list[dict]:
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("role") == "driver"]


def _events(job_dir: str) -> list[dict]:
    with open(os.path.join(job_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def _deterministic(metrics: dict) -> dict:
    """The metrics that do not measure time."""
    return {k: v for k, v in metrics.items()
            if not (k.endswith("_s") or k in ("ts", "time", "event"))}


def run_cartpole(job_dir: str, kill: str | None = None) -> dict:
    """The CartPole example for ``ITERATIONS`` iterations; with ``kill`` (an instance
    label: ``actor-0``, ``rollout-1``, ``driver``), SIGKILL that process once iteration
    ``KILL_AFTER`` was reported. Returns the summary."""
    from dlrover_core import load_spec

    spec = load_spec("examples/ppo_cartpole/job.yaml", [
        f"config.rl.iterations={ITERATIONS}", "config.rl.target_return=null",
        "config.rl.max_time_s=0", "config.rl.evaluate=false", f"name=ppo-fo-{kill or 'none'}"])
    return run_killing(spec, job_dir, kill, KILL_AFTER, poll_s=180, wait_s=300)[0]


@pytest.fixture(scope="module")
def unkilled(ray_cluster, tmp_path_factory):
    job_dir = str(tmp_path_factory.mktemp("unkilled"))
    summary = run_cartpole(job_dir)
    return summary, _rows(job_dir)


def _check_same_as_unkilled(unkilled, summary, job_dir):
    ref_summary, ref_rows = unkilled
    m = summary["metrics"]
    assert m["iterations"] == ITERATIONS
    # exactly once: every iteration's environment steps counted once
    assert m["total_env_steps"] == ITERATIONS * STEPS_PER_ITERATION
    assert _deterministic(m) == _deterministic(ref_summary["metrics"])
    rows = _rows(job_dir)
    its = [r["step"] for r in rows if "fit_s" not in r]
    # each iteration reported once, in order
    assert its == list(range(ITERATIONS))
    ref = {r["step"]: _deterministic(r) for r in ref_rows if "fit_s" not in r}
    got = {r["step"]: _deterministic(r) for r in rows if "fit_s" not in r}
    assert got == ref  # bit for bit, every iteration: mean_return, losses, counts


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["actor-0", "critic-0", "rollout-1", "driver"])
def test_killed_process_ends_where_the_unkilled_run_ends(unkilled, job_dir, kill):
    """SIGKILL of the actor or the critic (stateful: restored to the driver's last
    commit, the driver rolls back with it), of a rollout rank (its environments restored) or of the driver
    (the roles that ran ahead of its commit roll back): the run's metrics, iteration by
    iteration, equal the unkilled run's, and ``total_env_steps`` is exactly
    iterations x steps per iteration."""
    summary = run_cartpole(job_dir, kill)
    assert summary["restarts"]["total"] == 1
    _check_same_as_unkilled(unkilled, summary, job_dir)
    events = _events(job_dir)
    failed = [e for e in events if e["event"] == "instance_failed"]
    assert len(failed) == 1
    # the record says what was running: a served role killed mid-run is not "setup"
    assert failed[0]["phase"] == "run" and failed[0]["step"] >= KILL_AFTER
    # the graph decided the scope, and recovery_started says which and why
    [started] = [e for e in events if e["event"] == "recovery_started"]
    scope = started["scope"]
    driver_starts = [e["attempt"] for e in events
                     if e["event"] == "instance_started" and e["role"] == "driver"]
    if kill == "rollout-1":  # stateless role: replaced, the driver kept running
        assert started["restart_driver"] is False and driver_starts == [0]
        assert scope["restart"] == ["rollout-1"] and scope["rollback"] == []
        assert scope["retry"] == ["driver -> rollout"] and "stateless" in scope["why"]
    else:  # the driver restarts and rolls the stateful roles back to its commit
        assert started["restart_driver"] is True and driver_starts == [0, 1]
        assert {"actor", "critic"} <= set(scope["rollback"]), scope
        assert scope["why"]


TOY = "dlrover_plugin_ppo.toy"


def run_toy_grpo(job_dir: str, kill: str | None = None, hang: bool = False) -> dict:
    """The toy GRPO job (all four GRPO roles, two rollout ranks) for 12 iterations;
    ``kill``: an instance label to SIGKILL once iteration 3 was reported; ``hang``:
    rollout rank 1 hangs in iteration 6 (its first attempt) and the default hang bound
    of driver calls is 2 s."""
    from dlrover_plugin_ppo.builder import RLJobBuilder

    builder = (RLJobBuilder("grpo").name(f"grpo-fo-{kill or ('hang' if hang else 'none')}")
               .rl(iterations=12, prompts_per_iter=8, samples_per_prompt=4, kl_coef=0.01))
    if hang:
        builder = builder.config({"toy": {"hang_at": 6, "hang_rank": 1}}).failover(
            call_hang_min_s=2)
    job = (builder
           .actor(TOY, "ToyActor").resource(cpu=0.25)
           .rollout(TOY, "ToyRollout").total(2).resource(cpu=0.25)
           .reference(TOY, "ToyReference").resource(cpu=0.25)
           .reward(TOY, "ToyReward").resource(cpu=0.25)
           .build())
    return run_killing(job.spec, job_dir, kill, 3, poll_s=120, wait_s=180)[0]


@pytest.fixture(scope="module")
def toy_unkilled(ray_cluster, tmp_path_factory):
    job_dir = str(tmp_path_factory.mktemp("toy-unkilled"))
    summary = run_toy_grpo(job_dir)
    return summary, {r["step"]: _deterministic(r) for r in _rows(job_dir) if "fit_s" not in r}


def _check_same_as_toy_unkilled(toy_unkilled, summary, job_dir):
    ref, ref_rows = toy_unkilled
    assert _deterministic(summary["metrics"]) == _deterministic(ref["metrics"])
    rows = [r for r in _rows(job_dir) if "fit_s" not in r]
    assert [r["step"] for r in rows] == list(range(12))
    assert {r["step"]: _deterministic(r) for r in rows} == ref_rows


def _driver_kept_running(job_dir: str, label: str) -> list[dict]:
    events = _events(job_dir)
    [started] = [e for e in events if e["event"] == "recovery_started"]
    assert started["restart_driver"] is False
    assert started["scope"]["restart"] == [label]
    assert [e["attempt"] for e in events if e["event"] == "instance_started"
            and e["role"] == "driver"] == [0]
    return events


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["reward-0", "reference-0"])
def test_stateless_reward_and_reference_are_replaced_under_a_running_driver(
        toy_unkilled, job_dir, kill):
    """GRPO with a reward and a reference role: SIGKILL of either is recovered by
    replacing that rank alone; the driver keeps running (never restarted), retries its
    calls on the replacement, and the run's metrics equal an unkilled run's."""
    summary = run_toy_grpo(job_dir, kill)
    assert summary["restarts"]["total"] == 1
    _check_same_as_toy_unkilled(toy_unkilled, summary, job_dir)
    _driver_kept_running(job_dir, kill)


@pytest.mark.slow
def test_killed_grpo_actor_is_put_back_to_the_commit_and_ends_as_the_unkilled_run(
        toy_unkilled, job_dir):
    """GRPO's actor (stateful, ``rollback``) SIGKILLed after iteration 3 was reported:
    the rank and the driver restart, the actor comes back at the driver's last commit,
    and every iteration's metrics equal the unkilled run's (each reported once)."""
    summary = run_toy_grpo(job_dir, "actor-0")
    assert summary["restarts"]["total"] == 1
    assert summary["failures"][0]["role"] == "actor"
    _check_same_as_toy_unkilled(toy_unkilled, summary, job_dir)
    events = _events(job_dir)
    [started] = [e for e in events if e["event"] == "recovery_started"]
    assert started["restart_driver"] is True
    assert started["scope"]["restart"] == ["actor-0", "driver"]
    assert "actor" in started["scope"]["rollback"]
    assert [e["attempt"] for e in events if e["event"] == "instance_started"
            and e["role"] == "driver"] == [0, 1]


@pytest.mark.slow
def test_a_hung_role_call_is_a_failure_with_stacks_by_the_default_bound(toy_unkilled,
                                                                        job_dir):
    """No ``failover.hang_timeout_s``: a rollout call that runs far beyond its recent
    durations (bound max(call_hang_min_s=2 s, 10 x p99)) is a hang, with the stuck
    rank's stacks; the rank is replaced, the driver retries, the run ends as an
    unkilled one."""
    summary = run_toy_grpo(job_dir, hang=True)
    assert summary["restarts"]["total"] == 1
    _check_same_as_toy_unkilled(toy_unkilled, summary, job_dir)
    events = _driver_kept_running(job_dir, "rollout-1")
    [failed] = [e for e in events if e["event"] == "instance_failed"]
    assert (failed["role"], failed["rank"], failed["kind"]) == ("rollout", 1, "hang")
    assert "call rollout.generate_iteration has run for" in failed["message"]
    assert "call_hang_min_s=2" in failed["message"] and "p99" in failed["message"]
    assert "stacks:" in failed["message"]
    stacks = failed["message"].split("stacks: ")[1].split()[0].rstrip(";")
    with open(stacks if os.path.isabs(stacks) else os.path.join(job_dir, stacks)) as f:
        text = f.read()
    assert "rollout-1" in text and "generate" in text and "toy.py" in text  # where it hung
