"""Whole multimodal jobs on a real local Ray cluster (toy encoders, see
dlrover_plugin_multimodal.toy): placement as Ray reports it, embeddings that reach the
trainer without passing through the driver, the embedding cache, SPMD trainer ranks
under ddp, and a SIGKILLed text encoder recovered at process level."""

from __future__ import annotations

import json
import os
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

    # cache, keyed by caption text: the 64 captions are 12 distinct strings (3 phrasings
    # x 4 classes); the 4 zero-shot prompts were embedded by the evaluation before
    # training. A miss is a position whose caption was not cached yet (a caption twice
    # in its first batch misses twice, and runs once); the second epoch misses none
    ends = [r for r in driver_steps(job_dir) if "text_encoder_cache_hits" in r]
    first, second = ends[0], ends[1]
    assert (first["step"], second["step"]) == (3, 7)
    hits, misses = first["text_encoder_cache_hits"], first["text_encoder_cache_misses"]
    assert hits + misses == 64 + 4 and misses >= 12 + 4
    assert first["text_encoder_embedded"] == 12 + 4  # each distinct string ran once
    assert second["text_encoder_cache_misses"] == misses
    assert second["text_encoder_cache_hits"] == hits + 64
    assert m["text_encoder_embedded"] == 12 + 4


@pytest.mark.slow
def test_killed_text_encoder_is_replaced_alone_and_the_trainer_keeps_its_state(
        ray_cluster, job_dir):
    from dlrover_core.testing import run_killing

    job = (builder("mm-kill", epochs=10)
           .config({**builder("x", epochs=10)._spec["config"],
                    "toy": {"step_sleep_s": 0.2}})
           .checkpoint(every_steps=1)  # a commit, then its report, every step
           .workload("trainer", TOY, "ToyTrainer").resource(cpu=0.3)
           .workload("vision_encoder", TOY, "ToyVecEncoder").resource(cpu=0.3)
           .workload("text_encoder", TOY, "ToyTextEncoder").resource(cpu=0.3)
           .with_collocation("trainer", "vision_encoder")
           .build())
    summary, st = run_killing(job.spec, job_dir, "text_encoder-0", at_step=5, before_step=30)
    text_pid = st["instances"]["text_encoder-0"]["pid"]
    trainer_pid = st["instances"]["trainer-0"]["pid"]
    assert summary["restarts"]["process"] == 1 and summary["restarts"]["total"] == 1
    assert summary["failures"][0]["role"] == "text_encoder"
    m = summary["metrics"]
    assert m["zero_shot_accuracy"] >= 0.9
    # the replacement reloaded the persisted cache: across both processes every one of
    # the 12 distinct captions and 4 prompts went through the encoder network once
    assert m["text_encoder_cache_loaded"] > 0
    assert m["text_encoder_embedded"] + m["text_encoder_cache_loaded"] == 12 + 4

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
    # the driver kept running (the encoder is stateless: replaced, the step's calls
    # retried on the replacement; tests/test_failover.py checks the rest): each step
    # reported once, after its commit
    assert [a for a, _ in started["driver"]] == [0]
    steps = [r["step"] for r in driver_steps(job_dir) if "fit_s" not in r]
    assert sorted(steps) == list(range(40))  # the master logs in arrival order


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


def test_clip_loss_over_two_gloo_ranks_equals_one_process_on_the_whole_batch(ray_cluster):
    """Two real trainer ranks (gloo) each hold half of 8 pairs: all-gathered as open_clip
    does, each rank's loss is the 1-process loss on all 8, and the gradient of its own
    rows is those rows of the 1-process gradient."""
    import torch

    from dlrover_core.testing import spawn_role
    from dlrover_plugin_multimodal.contrastive import clip_loss

    g = torch.Generator().manual_seed(3)
    image, text = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
    scale = torch.tensor(1.5)
    a, b, s = (x.clone().requires_grad_(True) for x in (image, text, scale))
    loss, metrics = clip_loss(a, b, s)  # no process group here: one process, 8 pairs
    loss.backward()
    ranks = spawn_role("trainer", f"{TOY}:ClipLossProbe", 2, {}, backend="ddp")
    try:
        out = ray.get([h.call.remote("clip_loss_grads", image, text, scale) for h in ranks],
                      timeout=120)
    finally:
        for h in ranks:
            ray.kill(h)
    for r, o in enumerate(out):
        rows = slice(4 * r, 4 * r + 4)
        assert torch.allclose(o["loss"], loss.detach(), atol=1e-6)
        assert torch.allclose(o["image_grad"], a.grad[rows], atol=1e-6)
        assert torch.allclose(o["text_grad"], b.grad[rows], atol=1e-6)
        assert torch.allclose(o["scale_grad"], s.grad, atol=1e-6)
        assert o["i2t_accuracy"] == metrics["i2t_accuracy"]
    # without the gather each rank would contrast 4 pairs: a different loss
    local, _ = clip_loss(image[:4], text[:4], scale, gather=False)
    assert abs(float(local.detach()) - float(loss.detach())) > 1e-3


def test_encoder_payloads_are_owned_by_the_encoder_and_never_reach_the_driver(ray_cluster):
    """This test process calls the encoders and the trainer as the driver does. A 16 x 2048
    float32 image batch (128 KiB, above Ray's 100 KiB inline limit): the encoder owns
    its object, which sits in the object store of the encoder's node; the driver's
    process got only the record (ids and the reference, nested: Ray counts it there
    with no local reference and no submission), and its in-process object store grew
    by less than the payload's size."""
    from ray.core.generated.common_pb2 import Address

    from dlrover_core.testing import spawn_role
    from dlrover_plugin_multimodal.handoff import EncodedRefs

    config = {"multimodal": {
        "data": {"dataset": f"{TOY}:ToyPairs", "modalities": ["vec", "tag"],
                 "options": {"dim": 2048}},
        "encoders": {"vision_encoder": {"modality": "vec", "trainable": True, "cache": False,
                                        "workload": f"{TOY}:ToyVecEncoder"},
                     "text_encoder": {"modality": "tag", "persist_cache": False}},
        "batch_size": 16}}
    vision = spawn_role("vision_encoder", f"{TOY}:ToyVecEncoder", 1, config)
    text = spawn_role("text_encoder", f"{TOY}:ToyTextEncoder", 1, config)
    trainer = spawn_role("trainer", f"{TOY}:ToyTrainer", 1, config)
    core = ray._private.worker.global_worker.core_worker
    driver_bytes_before = core.get_local_memory_store_bytes_used()
    try:
        ids = list(range(16))
        vec = vision[0].call.remote("inputs", "train", ids)
        tag = text[0].call.remote("embed", "train", ids)
        inputs = {"vec": EncodedRefs("vision_encoder", "vec", "inputs", (vec,), ((0, 16),)),
                  "tag": EncodedRefs("text_encoder", "tag", "embeddings", (tag,), ((0, 16),))}
        out = ray.get(trainer[0].call.remote("train_step", 0, ids, inputs), timeout=120)
        assert out["samples"] == 16.0
        held_by_driver = dict(core.get_all_reference_counts())
        driver_bytes = core.get_local_memory_store_bytes_used()
        record_size = ray.experimental.get_object_locations([vec])[vec]["object_size"]
        assert record_size < 4096  # the record (ids and a reference) is all it got

        record = ray.get(vec)  # the test looks inside: the payload's reference
        payload = record["object"]
        # the driver knows the payload's id only as nested in the record (Ray's
        # bookkeeping of nested references): no reference of its own, none submitted
        assert held_by_driver[payload.hex().encode()] == {"local": 0, "submitted": 0}
        assert held_by_driver[vec.hex().encode()]["local"] == 1  # the record's
        assert driver_bytes - driver_bytes_before < 8192  # its in-process store: records
        owner = Address()
        owner.ParseFromString(payload.owner_address())
        encoder_worker = ray.get(vision[0].__ray_call__.remote(
            lambda self: ray.get_runtime_context().get_worker_id()))
        assert owner.worker_id.hex() == encoder_worker
        where = ray.experimental.get_object_locations([payload])[payload]
        assert where["object_size"] > 100 * 1024  # 16 x 2048 float32, not inlined
        encoder_node = ray.get(vision[0].node_info.remote())["node_id"]
        assert where["node_ids"] == [encoder_node]  # in the object store of that node
    finally:
        for h in vision + text + trainer:
            ray.kill(h)
