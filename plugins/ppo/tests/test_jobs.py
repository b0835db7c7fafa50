"""Whole ppo / grpo jobs on the real local Ray cluster: placement as Ray reports it,
worker-to-worker data (checked by where the data was deserialised), learning."""

from __future__ import annotations

import json
import os

import pytest
import ray

from dlrover_core.runtime.trace import read_traces
from dlrover_plugin_ppo.builder import RLJobBuilder

TOY = "dlrover_plugin_ppo.toy"


def read_json(path):
    with open(path) as f:
        return json.load(f)


def step_metrics(job_dir):
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r.get("role") == "driver"]


def test_grpo_collocated_roles_share_bundles_and_data_skips_the_driver(ray_cluster, job_dir,
                                                                        tmp_path):
    trace_dir = str(tmp_path)
    job = (RLJobBuilder("grpo").name("grpo-colloc")
           .rl(iterations=12, prompts_per_iter=8, samples_per_prompt=4, kl_coef=0.01,
               evaluate=True)
           .config({"toy": {"trace_dir": trace_dir}})
           .actor(TOY, "ToyActor").resource(cpu=0.3)
           .rollout(TOY, "ToyRollout").total(2).resource(cpu=0.3)
           .reference(TOY, "ToyReference").resource(cpu=0.3)
           .reward(TOY, "ToyReward").resource(cpu=0.2)
           .with_collocation("actor", "rollout", "reference")
           .build())
    summary = job.submit(job_dir=job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    m = summary["metrics"]
    assert m["accuracy_before"] == 0.25 and m["accuracy_after"] >= 0.9
    steps = step_metrics(job_dir)
    assert steps[-1]["reward_mean"] > steps[0]["reward_mean"] + 0.3

    p = read_json(os.path.join(job_dir, "placement.json"))
    actor, ref, reward = p["actor"][0], p["reference"][0], p["reward"][0]
    r0, r1 = p["rollout"]
    # collocated: one placement group; bundle i hosts rank i of every role in the group
    assert actor["placement_group_id"] == ref["placement_group_id"] == r0["placement_group_id"]
    assert r1["placement_group_id"] == actor["placement_group_id"]
    assert (actor["bundle"], ref["bundle"], r0["bundle"], r1["bundle"]) == (0, 0, 0, 1)
    assert len({actor["node_id"], ref["node_id"], r0["node_id"]}) == 1
    assert reward["placement_group_id"] != actor["placement_group_id"]
    # each of the 3 collocated actors asks Ray for a third of the 0.3-CPU bundle
    cpu = [v for k, v in actor["resources"].items() if k.startswith("CPU_group_0_")]
    assert cpu == [pytest.approx(0.1, abs=1e-3)]
    assert len({actor["pid"], ref["pid"], r0["pid"], r1["pid"]}) == 4  # separate processes

    seen = read_traces(os.path.join(trace_dir, "trace.log"))
    driver = p["driver"]["pid"]
    rollout_pids = {r0["pid"], r1["pid"]}
    for rank in (0, 1):
        # rollout batches were deserialised by the consumers, never by the driver
        assert seen[f"batch-{rank}"] == {actor["pid"], ref["pid"], reward["pid"]}
    assert seen["weights"] == rollout_pids | {ref["pid"]}
    assert driver not in set().union(*seen.values())


@pytest.mark.slow  # 15 s: make test's lanes stay under 10 minutes on 2 cores (CI runs it)
def test_ppo_separated_roles_get_their_own_placement_groups(ray_cluster, job_dir, tmp_path):
    job = (RLJobBuilder("ppo").name("ppo-separate")
           .rl(iterations=10, evaluate=True, epochs=2, minibatches=2)
           .config({"toy": {"trace_dir": str(tmp_path)}})
           .actor(TOY, "ToyActor").resource(cpu=0.25)
           .critic(TOY, "ToyCritic").resource(cpu=0.25)
           .rollout(TOY, "ToyRollout").total(2).resource(cpu=0.25)
           .reward(TOY, "ToyReward").resource(cpu=0.25)
           .build())
    summary = job.submit(job_dir=job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["metrics"]["accuracy_after"] > summary["metrics"]["accuracy_before"]
    assert "value_loss" in summary["metrics"] and "explained_variance" in summary["metrics"]
    p = read_json(os.path.join(job_dir, "placement.json"))
    pgs = {role: {i["placement_group_id"] for i in p[role]}
           for role in ("actor", "critic", "rollout", "reward")}
    assert all(len(v) == 1 for v in pgs.values())
    assert len(set.union(*pgs.values())) == 4  # no two roles share a placement group
    assert sorted(i["bundle"] for i in p["rollout"]) == [0, 1]
    whole = [v for k, v in p["actor"][0]["resources"].items() if k.startswith("CPU_group_0_")]
    assert whole == [pytest.approx(0.25)]  # not shared: the full bundle
    # rollout batches reach actor, critic and reward directly; the critic also gets the
    # actor's advantage batch (which carries the same tracer); never the driver
    seen = read_traces(str(tmp_path / "trace.log"))
    consumers = {p[r][0]["pid"] for r in ("actor", "critic", "reward")}
    assert seen["batch-0"] == seen["batch-1"] == consumers
    assert p["driver"]["pid"] not in set().union(*seen.values())


@pytest.mark.slow  # 13 s: make test's lanes stay under 10 minutes on 2 cores (CI runs it)
def test_short_cartpole_run_raises_the_return(ray_cluster, job_dir):
    """examples/ppo_cartpole from its job file, shortened to 10 iterations."""
    from dlrover_core import load_spec
    from dlrover_core.master.client import submit_job

    spec = load_spec("examples/ppo_cartpole/job.yaml", ["config.rl.iterations=10"])
    summary = submit_job(spec, job_dir=job_dir, progress=False)
    assert summary["status"] == "succeeded", summary["error"]
    returns = [s["mean_return"] for s in step_metrics(job_dir) if "mean_return" in s]
    assert returns[0] < 40  # a random policy balances the pole for about 20 steps
    assert returns[-1] > 2 * returns[0] and returns[-1] > 60
    assert summary["metrics"]["total_env_steps"] == 10 * 2 * 8 * 128


@pytest.mark.slow
def test_grpo_arith_example_raises_heldout_accuracy(ray_cluster, tmp_path):
    """Both stages of examples/grpo_arith from their job files, GRPO shortened."""
    from dlrover_core import load_spec
    from dlrover_core.master.client import submit_job

    ckpt = str(tmp_path / "policy.pt")
    sft = load_spec("examples/grpo_arith/sft.yaml", [f"config.sft.save_to={ckpt}"])
    s = submit_job(sft, job_dir=str(tmp_path / "sft"), progress=False)
    assert s["status"] == "succeeded", s["error"]
    assert os.path.exists(ckpt)
    grpo = load_spec("examples/grpo_arith/grpo.yaml", [f"config.arith.init_checkpoint={ckpt}",
                                                       "config.rl.iterations=30"])
    g = submit_job(grpo, job_dir=str(tmp_path / "grpo"), progress=False)
    assert g["status"] == "succeeded", g["error"]
    m = g["metrics"]
    assert m["accuracy_before"] == pytest.approx(s["metrics"]["accuracy"])
    assert m["eval_problems_after"] == 500
    assert m["accuracy_after"] >= m["accuracy_before"] + 0.05, m


def test_killed_driver_resumes_from_its_saved_iteration(ray_cluster, job_dir):
    """The PPO driver dies mid-run: it restarts alone, resumes at the iteration after
    the last one it saved, and the roles keep running (not restarted)."""
    import time

    from dlrover_core.master.client import create_master
    from dlrover_core.runtime.context import MASTER_NAMESPACE

    job = (RLJobBuilder("ppo").name("ppo-driver-kill")
           .rl(iterations=30, evaluate=False, epochs=1, minibatches=1)
           .actor(TOY, "ToyActor").resource(cpu=0.25)
           .critic(TOY, "ToyCritic").resource(cpu=0.25)
           .rollout(TOY, "ToyRollout").total(2).resource(cpu=0.25)
           .build())
    master = create_master(job.spec, job_dir)
    ray.get(master.start.remote())
    deadline = time.time() + 120
    while ray.get(master.status.remote())["step"] < 3:
        assert time.time() < deadline
        time.sleep(0.05)
    ray.kill(ray.get_actor("dlrover-ppo-driver-kill-driver-a0", namespace=MASTER_NAMESPACE))
    summary = ray.get(master.wait.remote(180))
    ray.kill(master)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["metrics"]["iterations"] == 30.0
    assert summary["restarts"]["process"] == 1
    rows = step_metrics(job_dir)
    # fit() ends with one more report of the last iteration, with the run's totals
    finals = [r["step"] for r in rows if "fit_s" in r]
    its = [r["step"] for r in rows if "fit_s" not in r]
    assert finals == [29] and its[-1] == 29
    # resumed, not started over, and each iteration reported once: the driver reports
    # after its commit, and a restarted driver reports its last commit again only when
    # the master never got it
    assert its == list(range(30))
    started = [e for e in map(json.loads, open(os.path.join(job_dir, "events.jsonl")))
               if e["event"] == "instance_started"]
    assert [e["attempt"] for e in started if e["role"] == "driver"] == [0, 1]
    assert all(e["attempt"] == 0 for e in started if e["role"] != "driver")
