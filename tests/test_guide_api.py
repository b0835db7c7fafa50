"""Seed 004 (DLRover's unified API guide) programs run on dlrover-core with only
their import lines changed: ``@ray.remote`` workloads with the guide's constructor,
the guide's trainer constructor and ``actor_handles`` style, every
``trainer_invocation`` example, and the builder without ``.name()``."""

from __future__ import annotations

import json
import os

import pytest

from dlrover_core import DLJobBuilder, SpecError
from tests.scenarios import run_scenario


def _guide_job(dl_type: str, actor_via: str = "actor"):
    b = DLJobBuilder().dl_type(dl_type).node_num(1).config({"k1": "v1"})
    b = b.trainer("tests.guide_programs", "UserTrainer")
    if actor_via == "actor":
        return b.actor("tests.guide_programs", "UserActorModel").total(2).per_node(2) \
            .resource(cpu=0.5)
    return b.workload("tests.guide_programs", "UserActorModel").total(2).per_node(2) \
        .resource(cpu=0.5)


@pytest.mark.parametrize("dl_type,role", [("RL", "actor"), ("SFT", "trainer")])
def test_guide_programs_run(ray_cluster, tmp_path, dl_type, role):
    dl_job = _guide_job(dl_type, "actor" if dl_type == "RL" else "workload").build()
    assert dl_job.name.startswith("usertrainer-")          # no .name(): derived, unique
    summary = dl_job.submit(job_dir=str(tmp_path / "job"))
    assert summary["status"] == "succeeded", summary["error"]
    out = json.load(open(os.path.join(str(tmp_path / "job"), "guide_fit.json")))
    # the guide's constructor got the master handle and the config; identity is right
    assert out["init"] == [{"role": role, "rank": r, "world_size": 2, "local_rank": r,
                            "local_world_size": 2, "name": f"{role}-{r}",
                            "is_actor": role == "actor", "collocation": "",
                            "master": True, "k1": "v1"} for r in (0, 1)]
    assert out["classes"] == {role: "UserActorModel"}      # actor_classes, unwrapped
    assert out["roles"] == [role]
    assert out["resource"] == {"cpu": 0.5, "gpu": 0.0}
    assert out["update"] == [1, 1]                         # RG call on both ranks
    assert out["handles"] == [2, 2]                        # h.update_actor.remote() per rank
    assert out["a"] == [10, 10]                            # blocking=False -> DRef
    assert out["b"] == [101, 101]                          # is_async + timeout
    assert out["c_low"] == [1, 1] and out["c_high"] == [8, 8]   # pre_function filter
    assert out["d"] == 21                                  # post_func over both ranks: 10 + 11


def test_default_names_differ_per_build():
    b = _guide_job("RL")
    assert b.build().name != b.build().name


def test_rl_needs_an_actor():
    b = (DLJobBuilder().dl_type("RL").trainer("tests.guide_programs", "UserTrainer")
         .rollout("tests.guide_programs", "UserActorModel"))
    with pytest.raises(SpecError, match=r"roles.actor: None is invalid \(the actor is mandatory"
                                        r" in dl_type RL; roles given: rollout\)"):
        b.build()


def test_job_level_workload_form():
    b = DLJobBuilder().dl_type("SFT").workload("tests.guide_programs", "UserActorModel")
    assert b.to_dict()["roles"] == {"trainer": {"workload": "tests.guide_programs:UserActorModel"}}
    with pytest.raises(SpecError, match=r"workload\(role, module, class\) in a RL job"):
        DLJobBuilder().dl_type("RL").workload("m", "C")
    with pytest.raises(SpecError, match=r"\(module_name, class_name\) or \(role, module_name"):
        DLJobBuilder().workload("only-one")


def test_trainer_invocation_alias_errors():
    from dlrover_core import trainer_invocation

    with pytest.raises(ValueError, match="give pre_func or its alias pre_function, not both"):
        trainer_invocation(pre_func=len, pre_function=len)


def test_guide_constructors_outside_dlrover_are_refused():
    from tests.guide_programs import UserActorModel, UserTrainer

    with pytest.raises(TypeError, match=r"created by dlrover inside its role's actor"):
        UserActorModel.__ray_actor_class__(None, {})
    with pytest.raises(TypeError, match=r"created by dlrover in the job's driver actor"):
        UserTrainer({}, {}, {})


def test_device_per_node_fills_gpus_and_refuses_what_cannot_fit():
    from dlrover_core.spec.loader import load_spec

    spec = {"name": "g", "device_per_node": 4, "node_num": 2,
            "roles": {"trainer": {"workload": "m.w:W", "total": 8, "per_node": 4},
                      "eval": {"workload": "m.w:W", "total": 1, "resources": {"gpu": 0}}},
            "collocation": []}
    s = load_spec(spec, ["template=null"])
    assert s.roles.trainer.resources.gpu == 1.0 and s.roles.eval.resources.gpu == 0.0
    assert load_spec({"name": "c", "roles": {"t": {"workload": "m.w:W"}}},
                     ["template=null"]).roles.t.resources.gpu == 0.0
    with pytest.raises(SpecError, match=r"roles.trainer.per_node: 4 is invalid \(4 instances x "
                                        r"resources.gpu=2 need 8 GPUs on one node\); allowed: at "
                                        r"most device_per_node=4"):
        load_spec(spec, ["template=null", "roles.trainer.resources.gpu=2"])
    with pytest.raises(SpecError, match=r"roles.trainer.total: 12 is invalid; allowed: at most "
                                        r"node_num x per_node = 2 x 4 = 8"):
        load_spec(spec, ["template=null", "roles.trainer.total=12"])


@pytest.mark.slow  # a whole RL job learning: ~20 s
def test_guide_rl_example_learns(ray_cluster, tmp_path):
    """examples/guide_rl: actor, rollout (2 ranks), reference and reward roles, written
    in the guide's style, with the guide's trainer; the policy learns the bandit."""
    from examples.guide_rl.run import build

    job = build(iterations=40)
    summary = job.submit(job_dir=str(tmp_path / "job"))
    assert summary["status"] == "succeeded", summary["error"]
    rows = [json.loads(line) for line in open(tmp_path / "job" / "metrics.jsonl")]
    rewards = [r["mean_reward"] for r in rows if r.get("role") == "driver"]
    assert len(rewards) == 40
    # a uniform policy earns 0.1; seeded, the run goes from ~0.17 to >= 0.9 by step 30
    assert rewards[0] < 0.4 and summary["metrics"]["mean_reward"] >= 0.8, rewards


@pytest.mark.slow
def test_gpus_from_the_spec(tmp_path):
    """device_per_node / enable_ray_auto_visible_device on a Ray cluster with 4 fake GPUs
    (Ray resources only: this machine has no GPU, so the GPUs are declared, not real;
    CUDA itself is not exercised): CUDA_VISIBLE_DEVICES, LOCAL_RANK and the chosen
    device per layout, read inside the instances and in the ``instance_started``
    events: a rank computes on a GPU Ray reserved for it; only collocated roles share."""
    out = run_scenario("fake_gpus", tmp_path, timeout=1200)
    for layout, res in out.items():
        assert res["status"] == "succeeded", (layout, res["error"])
    # the guide's program: device_per_node(4), no name, one GPU per instance by default
    guide = out["guide"]
    assert guide["name"].startswith("usertrainer-")
    assert guide["fit"]["resource"] == {"cpu": 0.25, "gpu": 1.0}

    def by(layout):
        return {(p["role"], p["rank"]): p for p in out[layout]["probes"]}

    def started(layout):
        return {(e["role"], e["rank"]): e for e in out[layout]["started"]
                if e["role"] != "driver"}

    def physical(e):  # the node's GPU id a rank computes on, from its event alone
        if e["visible_devices"] is None:
            return str(e["cuda_device"])
        return e["visible_devices"].split(",")[e["cuda_device"]]

    for layout in out:  # every event carries Ray's ids, the rank's env and its device
        assert len(started(layout)) in (4, 8), layout
        for key, e in started(layout).items():
            assert len(e["gpu_ids"]) == 1, (layout, e)
            assert physical(e) == e["gpu_ids"][0], (layout, e)   # the GPU Ray reserved
            p = by(layout).get(key)  # the guide's program has no probe
            if p is not None:
                assert e["gpu_ids"] == p["ray_gpu_ids"]
                assert e["visible_devices"] == p["CUDA_VISIBLE_DEVICES"]
                assert p["device"] == f"cuda:{e['cuda_device']}"
    assert len(by("two_slots")) == 4

    spmd = by("spmd")
    assert sorted(spmd) == [("trainer", r) for r in range(4)]
    for (_, r), p in spmd.items():   # every GPU visible; each rank picks its Ray GPU
        assert (p["CUDA_VISIBLE_DEVICES"], p["LOCAL_RANK"], p["gpu"]) == (None, str(r), 1.0)
        assert p["device"] == f"cuda:{p['ray_gpu_ids'][0]}"
    assert len({p["device"] for p in spmd.values()}) == 4   # 4 distinct GPUs
    ray_visible = by("spmd_ray_visible")
    for p in ray_visible.values():   # Ray's assignment: one visible GPU, cuda:0
        assert [p["CUDA_VISIBLE_DEVICES"]] == p["ray_gpu_ids"] and p["device"] == "cuda:0"
    assert len({p["CUDA_VISIBLE_DEVICES"] for p in ray_visible.values()}) == 4
    colloc = by("collocated")
    assert len(colloc) == 8
    for r in range(4):               # trainer r and eval r share one GPU (0.5 each)
        t, e = colloc[("trainer", r)], colloc[("eval", r)]
        assert t["gpu"] == e["gpu"] == 0.5
        assert t["ray_gpu_ids"] == e["ray_gpu_ids"] and t["device"] == e["device"]
        assert t["collocation"] == "TRAINER,EVAL"
    assert len({p["device"] for p in colloc.values()}) == 4
    # not collocated: trainer and eval never compute on one GPU (they did: cuda:0 and
    # cuda:1 for both roles, from local_rank)
    for layout in ("separated", "two_slots"):
        devices = [physical(e) for e in started(layout).values()]
        assert len(devices) == 4 and len(set(devices)) == 4, (layout, devices)
    sep = by("separated")
    for p in sep.values():
        assert p["gpu"] == 1.0
    slots = by("two_slots")          # two node slots of one role on one node
    assert len({p["device"] for p in slots.values()}) == 4


def test_constructor_styles_are_told_apart():
    from dlrover_core import BaseWorkload
    from dlrover_core.runtime.workload import guide_style_init

    class ContextExtra(BaseWorkload):
        def __init__(self, context, extra=None):
            super().__init__(context)

    class Guide(BaseWorkload):
        def __init__(self, master_handle, config):
            super().__init__(master_handle, config)

    class Three(BaseWorkload):
        def __init__(self, a, b, c):
            super().__init__(a)

    names = ("master_handle", "config")
    styles = [guide_style_init(c, BaseWorkload, names) for c in (ContextExtra, Guide)]
    assert styles == [False, True]
    with pytest.raises(TypeError, match=r"Three.__init__ takes 3 arguments; allowed: "
                                        r"\(self, context\) or \(self, master_handle, config\)"):
        guide_style_init(Three, BaseWorkload, names)
