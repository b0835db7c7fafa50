"""Whole multimodal jobs on a real local Ray cluster (toy encoders, see
dlrover_plugin_multimodal.toy): placement as Ray reports it, embeddings that reach the
trainer without passing through the driver, the embedding cache, SPMD trainer ranks
under ddp, and a SIGKILLed text encoder recovered at process level."""

from __future__ import annotations

import json
import os
import signal
from collections import defaultdict

import pytest
import ray

from dlrover_core import DLJobBuilder

TOY = "dlrover_plugin_multimodal.toy"


def builder(name, trace_dir=None, **mm):
    config = {"multimodal": {
        "data": {"dataset": f"{TOY}:ToyPairs", "modalities": ["vec", "tag"]},
        "encoders": {"vision_encoder": {"modality": "vec", "trainable": True},
                     "text_encoder": {"modality": "tag"}},
        "batch_size": 16, "epochs": 3, **mm}}
    if trace_dir:
        config["toy"] = {"trace_dir": trace_dir}
    return DLJobBuilder().name(name).dl_type("MULTIMODAL").config(config)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def driver_steps(job_dir):
    return [r for r in jsonl(os.path.join(job_dir, "metrics.jsonl")) if r.get("role") == "driver"]


def traces(trace_dir):
    seen = defaultdict(set)
    with open(os.path.join(trace_dir, "trace.log")) as f:
        for line in f:
            tag, pid = line.split()
            seen[tag].add(int(pid))
    return seen


def test_collocated_encoders_share_the_trainers_bundle_and_data_skips_the_driver(
        ray_cluster, job_dir, tmp_path):
    job = (builder("mm-colloc", trace_dir=str(tmp_path))
           .workload("trainer", TOY, "ToyTrainer").resource(cpu=0.3)
           .workload("vision_encoder", TOY, "ToyVecEncoder").resource(cpu=0.3)
           .workload("text_encoder", TOY, "ToyTextEncoder").resource(cpu=0.3)
           .with_collocation("trainer", "vision_encoder", "text_encoder")
           .build())
    summary = job.submit(job_dir=job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    m = summary["metrics"]
    assert m["zero_shot_accuracy"] >= 0.9 > m["zero_shot_accuracy_untrained"] + 0.3, m
    assert m["steps"] == 12  # 3 epochs of 64 samples in batches of 16

    p = read_json(os.path.join(job_dir, "placement.json"))
    trainer, vision, text = p["trainer"][0], p["vision_encoder"][0], p["text_encoder"][0]
    # one placement group, bundle 0 hosts rank 0 of all three roles, on one node
    assert trainer["placement_group_id"] == vision["placement_group_id"] \
        == text["placement_group_id"]
    assert (trainer["bundle"], vision["bundle"], text["bundle"]) == (0, 0, 0)
    assert len({trainer["node_id"], vision["node_id"], text["node_id"]}) == 1
    cpu = [v for k, v in trainer["resources"].items() if k.startswith("CPU_group_0_")]
    assert cpu == [pytest.approx(0.1, abs=1e-3)]  # a third of the shared 0.3-CPU bundle
    assert len({trainer["pid"], vision["pid"], text["pid"]}) == 3  # separate processes

    # every encoder output was deserialised by the trainer and by no other process
    seen = traces(str(tmp_path))
    assert seen["text_encoder-0"] == {trainer["pid"]}
    assert seen["vision_encoder-0"] == {trainer["pid"]}
    assert p["driver"]["pid"] not in set().union(*seen.values())


def test_separated_text_encoder_caches_and_ddp_trainer_ranks_split_the_batch(
        ray_cluster, job_dir):
    job = (builder("mm-separate", epochs=2)
           .workload("trainer", TOY, "ToyTrainer").total(2).backend("ddp").resource(cpu=0.3)
           .workload("vision_encoder", TOY, "ToyVecEncoder").total(2).resource(cpu=0.3)
           .workload("text_encoder", TOY, "ToyTextEncoder").resource(cpu=0.3)
           .with_collocation("trainer", "vision_encoder")
           .build())
    summary = job.submit(job_dir=job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    m = summary["metrics"]
    assert m["samples"] == 16.0  # both trainer ranks trained on their 8 samples of a step
    p = read_json(os.path.join(job_dir, "placement.json"))
    trainer_pg = {i["placement_group_id"] for i in p["trainer"]}
    assert trainer_pg == {i["placement_group_id"] for i in p["vision_encoder"]}
    assert len(trainer_pg) == 1
    assert [i["bundle"] for i in p["trainer"]] == [i["bundle"] for i in p["vision_encoder"]] \
        == [0, 1]
    text_pg = p["text_encoder"][0]["placement_group_id"]
    assert text_pg not in trainer_pg  # separated: a placement group of its own
    whole = [v for k, v in p["text_encoder"][0]["resources"].items()
             if k.startswith("CPU_group_0_")]
    assert whole == [pytest.approx(0.3)]  # not shared: the whole bundle

    # cache: the first epoch misses every train sample, the second hits every one;
    # the 4 zero-shot prompts were embedded once, by the evaluation before training
    ends = [r for r in driver_steps(job_dir) if "text_encoder_cache_hits" in r]
    first, second = ends[0], ends[1]
    assert (first["step"], second["step"]) == (3, 7)
    assert first["text_encoder_cache_misses"] == 64 + 4 and first["text_encoder_cache_hits"] == 0
    assert second["text_encoder_cache_misses"] == 64 + 4
    assert second["text_encoder_cache_hits"] == 64
    assert m["text_encoder_embedded"] == 64 + 4  # each sample ran through the network once
    assert m["text_encoder_cache_hits"] == 64


def test_killed_text_encoder_is_replaced_alone_and_the_trainer_keeps_its_state(
        ray_cluster, job_dir):
    from dlrover_core.master.client import create_master
    from dlrover_core.testing import poll_status

    job = (builder("mm-kill", epochs=10)
           .config({**builder("x", epochs=10)._spec["config"],
                    "toy": {"step_sleep_s": 0.2}})
           .workload("trainer", TOY, "ToyTrainer").resource(cpu=0.3)
           .workload("vision_encoder", TOY, "ToyVecEncoder").resource(cpu=0.3)
           .workload("text_encoder", TOY, "ToyTextEncoder").resource(cpu=0.3)
           .with_collocation("trainer", "vision_encoder")
           .build())
    master = create_master(job.spec, job_dir)
    ray.get(master.start.remote())
    st = poll_status(master, lambda s: s["state"] == "running" and 5 <= s["step"] < 30)
    text_pid = st["instances"]["text_encoder-0"]["pid"]
    trainer_pid = st["instances"]["trainer-0"]["pid"]
    os.kill(text_pid, signal.SIGKILL)
    summary = ray.get(master.wait.remote(300))
    ray.kill(master)
    assert summary["status"] == "succeeded", summary["error"]
    assert summary["restarts"]["process"] == 1 and summary["restarts"]["total"] == 1
    assert summary["failures"][0]["role"] == "text_encoder"
    m = summary["metrics"]
    assert m["zero_shot_accuracy"] >= 0.9
    # the replacement reloaded the persisted cache: across both processes every one of
    # the 64 captions and 4 prompts went through the encoder network exactly once
    assert m["text_encoder_cache_loaded"] > 0
    assert m["text_encoder_embedded"] + m["text_encoder_cache_loaded"] == 64 + 4

    events = jsonl(os.path.join(job_dir, "events.jsonl"))
    started = defaultdict(list)
    for e in events:
        if e["event"] == "instance_started":
            started[e["role"]].append((e["attempt"], e["pid"]))
    assert [a for a, _ in started["text_encoder"]] == [0, 1]
    assert started["text_encoder"][1][1] != text_pid
    # the trainer and the trainable encoder's role were never restarted
    assert started["trainer"] == [(0, trainer_pid)]
    assert [a for a, _ in started["vision_encoder"]] == [0]
    # the restarted driver resumed at the trainer's step (train_step refuses any other):
    # no step trained twice; only the step(s) in flight at the kill went unreported
    steps = [r["step"] for r in driver_steps(job_dir) if "fit_s" not in r]
    assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] == 39
    assert len(steps) >= 40 - 1 - job.spec.config.multimodal.prefetch


def test_a_lost_encoder_output_stops_every_ddp_trainer_rank_together(ray_cluster):
    """Trainer rank 1's share of a step comes from an encoder that died: both ranks raise
    UpstreamLost (rank 0 because they agree first), none trains or waits in DDP's
    all-reduce; the next step then trains on both."""
    import torch

    from dlrover_core.testing import spawn_role
    from dlrover_plugin_multimodal.handoff import EncodedRefs

    config = {"multimodal": {
        "data": {"dataset": f"{TOY}:ToyPairs", "modalities": ["vec", "tag"]},
        "encoders": {"vision_encoder": {"modality": "vec", "trainable": True, "cache": False,
                                        "workload": f"{TOY}:ToyVecEncoder"},
                     "text_encoder": {"modality": "tag"}},
        "batch_size": 4}}
    trainers = spawn_role("trainer", f"{TOY}:ToyTrainer", 2, config, backend="ddp")

    @ray.remote(num_cpus=0)
    class Producer:
        def slow(self):
            import time
            time.sleep(600)

    producer = Producer.remote()
    lost = producer.slow.remote()
    ray.kill(producer)

    def vec(a, b):
        return ray.put({"ids": torch.arange(a, b), "inputs": torch.randn(b - a, 8)})

    def tag(a, b):
        return ray.put({"ids": torch.arange(a, b), "embeddings": torch.randn(b - a, 16)})

    bounds = ((0, 2), (2, 4))
    ids = [0, 1, 2, 3]
    try:
        broken = {"vec": EncodedRefs("vision_encoder", "vec", "inputs", (vec(0, 2), lost), bounds),
                  "tag": EncodedRefs("text_encoder", "tag", "embeddings",
                                     (tag(0, 2), tag(2, 4)), bounds)}
        calls = [h.call.remote("train_step", 0, ids, broken) for h in trainers]
        errors = []
        for ref in calls:
            with pytest.raises(ray.exceptions.RayTaskError) as err:
                ray.get(ref, timeout=300)
            errors.append(str(err.value))
        assert "UpstreamLost" in errors[0] and "another trainer rank" in errors[0]
        assert "UpstreamLost" in errors[1] and "vision_encoder" not in errors[0]
        assert ray.get([h.call.remote("trained_steps") for h in trainers]) == [0, 0]
        good = {"vec": EncodedRefs("vision_encoder", "vec", "inputs", (vec(0, 2), vec(2, 4)),
                                   bounds),
                "tag": broken["tag"]}
        out = ray.get([h.call.remote("train_step", 0, ids, good) for h in trainers], timeout=300)
        assert [o["samples"] for o in out] == [2.0, 2.0]
        assert ray.get([h.call.remote("trained_steps") for h in trainers]) == [1, 1]
    finally:
        for h in trainers:
            ray.kill(h)
