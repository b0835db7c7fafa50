"""The megatron plugin on the CPU: real megatron-core tensor-parallel layers in real
Ray actors over gloo. TP=2 equals TP=1; checkpoints round-trip bit for bit through
the disk and flash savers and move from TP=2 to TP=1; bad sizes are refused at spec
load; Megatron failures are classified."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch

from dlrover_core import Failure, load_spec
from dlrover_core.spec.errors import SpecError
from dlrover_core.testing import (
    assert_states_equal,
    call_all,
    heavy_modules_after,
    kill_actors,
    plugin_row,
    spawn_role,
)

pytest.importorskip("megatron.core")

W = "plugins.megatron.tests.megatron_workloads:TPTrainer"


def start(world_size: int, tp: int, **config) -> list:
    return spawn_role("trainer", W, world_size, {"tensor_parallel": tp, **config},
                      backend="megatron", job=f"mg-{uuid.uuid4().hex[:8]}")


# --------------------------------------------------------------------------- registration
def test_active_in_plugins_list():
    row = plugin_row("megatron")
    assert row["status"] == "active", row["error"]
    assert row["distribution"] == "dlrover-plugin-megatron"
    assert row["provides"] == ["backend:megatron", "engine:megatron"]


def test_plugin_module_imports_no_torch_or_megatron():
    code = "import dlrover_plugin_megatron.plugin as p; p.dlrover_backends()"
    assert heavy_modules_after(code, ["torch", "megatron"]) == []


# --------------------------------------------------------------------------- spec load
def _spec(total: int = 2, role_config: dict | None = None, **config):
    return {"name": "mg", "roles": {"trainer": {
        "workload": "examples.megatron_gpt.workload:MegatronGPTWorkload", "total": total,
        "backend": "megatron", "config": role_config or {}}},
        "config": {"num_layers": 4, "num_attention_heads": 4, "hidden_size": 128, **config}}


@pytest.mark.parametrize("total,role_config,config,key,value,allowed", [
    (2, {"tensor_parallel": 3}, {}, "roles.trainer.config.tensor_parallel", 3,
     "divides the role's world size 2 (a divisor of 2: 1, 2)"),
    (4, {"tensor_parallel": 2, "pipeline_parallel": 4}, {},
     "roles.trainer.config.tensor_parallel", 2, "a divisor of 4: 1, 2, 4"),
    (4, {}, {"tensor_parallel": 4, "num_attention_heads": 6, "hidden_size": 96},
     "config.num_attention_heads", 6, "a multiple of tensor_parallel=4"),
    (4, {"pipeline_parallel": 4}, {"num_layers": 6}, "config.num_layers", 6,
     "a multiple of pipeline_parallel=4 = 4"),
    # not supported: refused with the reason (nothing builds chunks / splits sequences)
    (4, {"pipeline_parallel": 2, "virtual_pipeline": 2}, {},
     "roles.trainer.config.virtual_pipeline", 2, "none or 1"),
    (4, {"context_parallel": 2}, {}, "roles.trainer.config.context_parallel", 2, "1"),
    (2, {"virtual_pipeline": 2}, {}, "roles.trainer.config.virtual_pipeline", 2,
     "none or 1 unless pipeline_parallel >= 2"),
    (2, {"tensor_parallel": 0}, {}, "roles.trainer.config.tensor_parallel", 0,
     "an integer >= 1"),
    (2, {"tensor_parallel": "two"}, {}, "roles.trainer.config.tensor_parallel", "two",
     "an integer >= 1"),
])
def test_bad_parallel_sizes_refused_at_spec_load(total, role_config, config, key, value, allowed):
    with pytest.raises(SpecError) as err:
        load_spec(_spec(total, role_config, **config))
    assert err.value.key == key
    assert err.value.value == value
    assert allowed in err.value.allowed


def test_good_sizes_load():
    spec = load_spec(_spec(8, {"tensor_parallel": 2, "pipeline_parallel": 2,
                               "virtual_pipeline": 1}))
    assert spec.roles.trainer.config.tensor_parallel == 2
    spec = load_spec("examples/megatron_gpt/job.yaml")
    assert spec.roles.trainer.backend == "megatron"


# --------------------------------------------------------------------------- failures
def _classify(message: str, history=(), **kw):
    from dlrover_plugin_megatron.failures import classify

    return classify(Failure.user_error("trainer", kw.pop("rank", 1), "builtins.RuntimeError",
                                       message, **kw), list(history))


def test_megatron_size_assertions_are_fatal():
    v = _classify("world_size (6) is not divisible by 4", phase="setup")
    assert v.level == "fatal" and "roles.trainer.config.tensor_parallel" in v.reason
    v = _classify("num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4).")
    assert v.level == "fatal" and "num_attention_heads (6)" in v.reason
    v = _classify("AssertionError\n30 is not divisible by 4")
    assert v.level == "fatal"


def test_nccl_timeouts_restart_the_process_then_move_the_node():
    msg = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
           "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.")
    first = _classify(msg, node_id="n1", step=40)
    assert first.level == "process" and "NCCL" in first.reason and "pg_timeout_s" in first.reason
    earlier = [Failure.actor_died("trainer", 0, msg, node_id="n1", step=s) for s in (10, 20)]
    assert _classify(msg, earlier, node_id="n1", step=40).level == "node"
    assert _classify(msg, earlier, node_id="n2", step=40).level == "process"


def test_cuda_illegal_memory_access():
    msg = "CUDA error: an illegal memory access was encountered"
    assert _classify(msg, node_id="n1", step=7).level == "process"
    same_node = [Failure.user_error("trainer", 0, "RuntimeError", msg, node_id="n1", step=3)]
    assert _classify(msg, same_node, node_id="n1", step=7).level == "node"
    same_step = [Failure.user_error("trainer", 0, "RuntimeError", msg, node_id="n2", step=7)]
    v = _classify(msg, same_step, node_id="n1", step=7)
    assert v.level == "fatal" and "CUDA_LAUNCH_BLOCKING" in v.reason


def test_other_failures_are_left_to_the_next_classifier():
    assert _classify("ValueError: bad batch") is None


# --------------------------------------------------------------------------- numerics
def test_tp2_forward_and_gradients_equal_tp1(ray_cluster):
    tp1 = start(1, 1)
    tp2 = start(2, 2)
    try:
        weights = call_all(tp1, "full_params")[0]
        call_all(tp2, "set_full_params", weights)
        g = torch.Generator().manual_seed(7)
        x = torch.randint(0, 20, (3, 16), generator=g)
        y = torch.randint(0, 20, (3, 16), generator=g)
        ref = call_all(tp1, "forward_backward", x, y)[0]
        outs = call_all(tp2, "forward_backward", x, y)
        assert ref["logits"].shape == (16, 3, 32)
        for out in outs:  # both TP ranks hold the whole result after the gathers
            assert out["loss"] == pytest.approx(ref["loss"], abs=1e-5)
            torch.testing.assert_close(out["logits"], ref["logits"], rtol=0, atol=1e-5)
            assert out["grads"].keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                assert float(grad.abs().max()) > 0, name  # every parameter gets a gradient
                torch.testing.assert_close(out["grads"][name], grad, rtol=0, atol=1e-5,
                                           msg=name)
        # TP=2 splits the weights: each rank holds half of every column/row-parallel one
        locals_ = call_all(tp2, "flat_state")
        assert locals_[0][".model.layers.0.attn.qkv.weight"].shape == (48, 32)
        assert not torch.equal(locals_[0][".model.layers.0.attn.qkv.weight"],
                               locals_[1][".model.layers.0.attn.qkv.weight"])
        # a TP layer hidden in a plain torch container would be saved as if whole: refused
        err = call_all(tp2, "hidden_split_error")[0]
        assert "blocks.0.weight is a tensor-parallel parameter" in err and "MegatronModule" in err
    finally:
        kill_actors(tp1 + tp2)


@pytest.mark.slow
def test_pipeline_stages_equal_one_stage(ray_cluster):
    """The GPipe step over PP=2 (and TP=2 x PP=2) stages with 3 micro-batches gives the
    loss and gradients of one PP=1 step on the whole batch with the same weights."""
    tp1 = start(1, 1)
    pp2 = start(2, 1, pipeline_parallel=2)
    tp2pp2 = start(4, 2, pipeline_parallel=2)
    try:
        weights = call_all(tp1, "full_params")[0]
        g = torch.Generator().manual_seed(11)
        x = torch.randint(0, 20, (3, 16), generator=g)
        y = torch.randint(0, 20, (3, 16), generator=g)
        ref = call_all(tp1, "forward_backward", x, y)[0]
        for hs in (pp2, tp2pp2):
            call_all(hs, "set_full_params", weights)
            outs = call_all(hs, "pipelined_forward_backward", x, y, 3)
            grads: dict = {}
            for out in outs:  # every stage reports the last stage's loss
                assert out["loss"] == pytest.approx(ref["loss"], abs=1e-5)
                grads.update(out["grads"])
            stage_names = [set(o["grads"]) for o in outs]
            assert stage_names[0] != stage_names[-1]  # stages hold different layers
            assert grads.keys() == ref["grads"].keys()
            for name, grad in ref["grads"].items():
                torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5, msg=name)
    finally:
        kill_actors(tp1 + pp2 + tp2pp2)


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.slow
def test_disk_round_trip_bit_exact_and_tp2_loads_at_tp1(ray_cluster, tmp_path):
    ckpt = {"saver": "disk", "dir": str(tmp_path / "ckpt"), "keep": 2}
    hs = start(2, 2, ckpt=ckpt)
    losses = call_all(hs, "train", 3)[0]
    call_all(hs, "save", 3)
    saved = call_all(hs, "flat_state")
    full = call_all(hs, "full_params")[0]
    moments = call_all(hs, "full_optimizer_state")[0]
    x = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = call_all(hs, "logits", x)[0]
    continued = call_all(hs, "train", 2)
    kill_actors(hs)

    hs = start(2, 2, ckpt=ckpt)  # same layout: bit for bit, and the same next steps
    assert [r["step"] for r in call_all(hs, "load")] == [3, 3]
    assert_states_equal(call_all(hs, "flat_state"), saved)
    assert call_all(hs, "train", 2) == continued
    kill_actors(hs)

    one = start(1, 1, ckpt=ckpt)  # TP=2 -> TP=1: the global tensors are the same
    try:
        assert call_all(one, "load")[0]["step"] == 3
        loaded = call_all(one, "full_params")[0]
        assert loaded.keys() == full.keys()
        for k in full:
            assert torch.equal(loaded[k], full[k]), k
        loaded_moments = call_all(one, "full_optimizer_state")[0]
        assert loaded_moments.keys() == moments.keys() and moments
        for k in moments:
            assert torch.equal(loaded_moments[k], moments[k]), k
        torch.testing.assert_close(call_all(one, "logits", x)[0], logits, rtol=0, atol=1e-5)
        assert losses[-1] < losses[0]
    finally:
        kill_actors(one)


@pytest.mark.parametrize("workload,saver,source", [
    ("TPTrainer", "disk", "disk"),
    # the same resize through another layout of the stack; slow: make test's lanes
    # stay under 10 minutes on 2 cores (CI runs it)
    pytest.param("StackedTrainer", "disk", "disk", marks=pytest.mark.slow),
    pytest.param("TPTrainer", "flash", "memory-resharded", marks=pytest.mark.slow)])
def test_pp2_checkpoint_loads_at_pp1(ray_cluster, tmp_path, workload, saver, source):
    """Two pipeline stages of a 4-block model save: the first holds the embeddings and
    blocks 0-1, the last blocks 2-3, the final norm and the output layer. One stage
    with the whole model loads the same tensors and AdamW moments (blocks keep their
    global names; ``StackedTrainer`` saves them as megatron-core's TransformerBlock
    does, one key per parameter with the global layer index as a prepended axis), and
    its loss on a batch is the two stages' pipelined loss. Through the flash saver each
    stage's buffer holds only its part, and the one stage takes each tensor from the
    saved rank that holds it (from memory)."""
    job = f"mgpp-{uuid.uuid4().hex[:8]}"
    ckpt = {"saver": saver, "dir": str(tmp_path / "ckpt"), "keep": 2}
    w = f"plugins.megatron.tests.megatron_workloads:{workload}"
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randint(0, 20, (2, 16), generator=g) for _ in range(2))
    try:
        two = spawn_role("trainer", w, 2, {"pipeline_parallel": 2, "num_layers": 4,
                                           "ckpt": ckpt}, backend="megatron", job=job)
        try:
            call_all(two, "step")
            call_all(two, "save", 1)
            parts = call_all(two, "full_params")
            moments = call_all(two, "full_optimizer_state")
            saved_names = [[k for k in flat if k.startswith(".model.")]
                           for flat in call_all(two, "flat_state")]
            pipelined = call_all(two, "pipelined_forward_backward", x, y, 2)
        finally:
            kill_actors(two)
        first, last = parts
        assert {"embedding.weight", "position.weight"} <= first.keys()
        assert not {"embedding.weight", "position.weight"} & last.keys()
        assert {"output.weight", "ln_f.weight", "ln_f.bias"} <= last.keys()
        assert not {"output.weight", "ln_f.weight", "ln_f.bias"} & first.keys()
        assert {k.split(".")[1] for k in first if k.startswith("layers.")} == {"0", "1"}
        assert {k.split(".")[1] for k in last if k.startswith("layers.")} == {"2", "3"}
        stacked = [{k.rsplit("#", 1)[1] for k in names if "#" in k} for names in saved_names]
        if workload == "StackedTrainer":
            assert stacked == [{"0", "1"}, {"2", "3"}]  # ``<key>#<global layer>``
            assert not any(k.startswith(".model.layers.0.") for k in saved_names[0])
        else:
            assert stacked == [set(), set()]
        one = spawn_role("trainer", w, 1, {"pipeline_parallel": 1, "num_layers": 4,
                                           "ckpt": ckpt}, backend="megatron", job=job)
        try:
            before = call_all(one, "full_params")[0]
            assert call_all(one, "load") == [{"step": 1, "source": source}]
            loaded = call_all(one, "full_params")[0]
            loaded_moments = call_all(one, "full_optimizer_state")[0]
            loss = call_all(one, "forward_backward", x, y)[0]["loss"]
        finally:
            kill_actors(one)
    finally:
        if saver == "flash":
            from dlrover_plugin_flashckpt.persister import finish_job

            finish_job(job, timeout=30)
    saved = {**first, **last}
    assert loaded.keys() == saved.keys() == before.keys()
    assert not all(torch.equal(before[k], saved[k]) for k in saved)  # loading changed it
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), k
    saved_moments = {**moments[0], **moments[1]}
    assert loaded_moments.keys() == saved_moments.keys() and saved_moments
    for k in saved_moments:
        assert torch.equal(loaded_moments[k], saved_moments[k]), k
    assert loss == pytest.approx(pipelined[-1]["loss"], abs=1e-5)


def test_stacked_layer_placement():
    """A stacked-layer tensor (``prepend_axis_num=1``: megatron-core's
    ``decoder.layers.*``) is named by its global layer index, and its tensor-parallel
    split is found on the axes after the stacked one."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from dlrover_plugin_megatron.sharding import Placement, UnsupportedShardingError, placement_of

    local = torch.zeros(4, 8)  # rows 4..7 of layer 3's [8, 8] weight, TP rank 1 of 2
    st = ShardedTensor.from_rank_offsets("decoder.layers.mlp.linear_fc1.weight", local,
                                         (0, 3, 5), (1, 1, 2), prepend_axis_num=1)
    assert placement_of(st, 2, 1) == Placement("decoder.layers.mlp.linear_fc1.weight#3",
                                               (8, 8), 0, 2)
    whole = ShardedTensor.from_rank_offsets("decoder.layers.ln.weight", torch.zeros(8),
                                            (0, 2, 5), prepend_axis_num=1)
    assert placement_of(whole, 1, 0) == Placement("decoder.layers.ln.weight#2", (8,), None, 1)
    nested = ShardedTensor.from_rank_offsets("decoder.layers.experts.w", torch.zeros(8),
                                             (0, 1, 4), (1, 6, 8), prepend_axis_num=2)
    assert placement_of(nested, 1, 0).name == "decoder.layers.experts.w#1.6"
    with pytest.raises(UnsupportedShardingError, match="along axis 0 at offset 4"):
        placement_of(st, 2, 0)  # the shard is rank 1's, not rank 0's


@pytest.mark.slow
def test_flash_round_trip_bit_exact(ray_cluster, tmp_path):
    from dlrover_plugin_flashckpt import hygiene
    from dlrover_plugin_flashckpt.persister import finish_job

    job = f"mgflash-{uuid.uuid4().hex[:8]}"
    ckpt = {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}

    def flash_role():
        return spawn_role("trainer", W, 2, {"tensor_parallel": 2, "ckpt": ckpt},
                          backend="megatron", job=job)

    try:
        hs = flash_role()
        call_all(hs, "train", 3)
        call_all(hs, "save", 3)
        saved = call_all(hs, "flat_state")
        call_all(hs, "wait")
        continued = call_all(hs, "train", 2)
        kill_actors(hs)

        hs = flash_role()
        assert call_all(hs, "load") == [{"step": 3, "source": "memory"}] * 2
        assert_states_equal(call_all(hs, "flat_state"), saved)
        assert call_all(hs, "train", 2) == continued
        kill_actors(hs)

        hygiene.remove_job("/dev/shm", job)  # as after a node loss: only the disk is left
        hs = flash_role()
        assert call_all(hs, "load") == [{"step": 3, "source": "disk"}] * 2
        assert_states_equal(call_all(hs, "flat_state"), saved)
        assert call_all(hs, "train", 2) == continued
        kill_actors(hs)
    finally:
        finish_job(job, timeout=30)


@pytest.mark.slow
def test_flash_checkpoint_changes_layout(ray_cluster, tmp_path):
    """A TP=2 flash checkpoint loads at TP=1 x DP=2 (same world size: from every saved
    rank's buffer on this node) and at TP=1 in one rank, from memory; that rank's own
    save (whole tensors) loads back at TP=2; once shared memory is gone, the TP=2 step
    loads at TP=1 x DP=2 from the disk copy. Every time the global tensors, the AdamW
    moments and the outputs are those of the TP=2 job."""
    from dlrover_plugin_flashckpt import hygiene
    from dlrover_plugin_flashckpt.persister import finish_job

    job = f"mgrelayout-{uuid.uuid4().hex[:8]}"
    ckpt = {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}

    def role(world_size: int, tp: int) -> list:
        return spawn_role("trainer", W, world_size, {"tensor_parallel": tp, "ckpt": ckpt},
                          backend="megatron", job=job)

    x = torch.randint(0, 20, (2, 16), generator=torch.Generator().manual_seed(3))
    try:
        hs = role(2, 2)
        call_all(hs, "train", 3)
        call_all(hs, "save", 3)
        full = call_all(hs, "full_params")[0]
        moments = call_all(hs, "full_optimizer_state")[0]
        logits = call_all(hs, "logits", x)[0]
        call_all(hs, "wait")
        kill_actors(hs)

        # (world size, TP, step asked, step and source expected, then save this step)
        phases = [(2, 1, None, 3, "memory-resharded", None),
                  (1, 1, None, 3, "memory-resharded", 4),
                  (2, 2, None, 4, "memory-resharded", None),
                  (2, 1, 3, 3, "disk-resharded", None)]
        for world_size, tp, ask, step, source, save in phases:
            if source == "disk-resharded":
                hygiene.remove_job("/dev/shm", job)  # only the disk copies are left
            hs = role(world_size, tp)
            try:
                assert call_all(hs, "load", ask) == [{"step": step, "source": source}] * world_size
                where = (world_size, tp, source)
                for rank_params in call_all(hs, "full_params"):  # DP ranks: equal replicas
                    assert rank_params.keys() == full.keys()
                    for k in full:
                        assert torch.equal(rank_params[k], full[k]), (where, k)
                loaded_moments = call_all(hs, "full_optimizer_state")[0]
                assert loaded_moments.keys() == moments.keys() and moments
                for k in moments:
                    assert torch.equal(loaded_moments[k], moments[k]), (where, k)
                torch.testing.assert_close(call_all(hs, "logits", x)[0], logits, rtol=0, atol=1e-5)
                if save is not None:
                    call_all(hs, "save", save)
                    call_all(hs, "wait")
            finally:
                kill_actors(hs)
    finally:
        finish_job(job, timeout=30)


# --------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_gpt_model_trains_and_round_trips_through_flash(ray_cluster, tmp_path):
    """megatron-core GPTModel at TP=1 on one GPU: the loss falls, and a flash checkpoint
    restores it bit for bit (from memory, then from disk)."""
    from dlrover_plugin_flashckpt import hygiene
    from dlrover_plugin_flashckpt.persister import finish_job

    job = f"mggpu-{uuid.uuid4().hex[:8]}"
    ckpt = {"saver": "flash", "dir": str(tmp_path / "ckpt"), "keep": 2}
    gpt = "plugins.megatron.tests.megatron_workloads:GPTTrainer"

    def role():
        from dlrover_core.runtime.context import WorkerContext
        from dlrover_core.runtime.host import remote_workload_host

        h = remote_workload_host().options(num_cpus=0, num_gpus=1).remote(gpt, WorkerContext(
            job=job, role="trainer", rank=0, world_size=1, local_rank=0, local_world_size=1,
            backend="megatron", config={"tensor_parallel": 1, "ckpt": ckpt},
            failover={"pg_timeout_s": 60}))
        info = ray.get(h.node_info.remote())
        ray.get(h.setup.remote(info["ip"], ray.get(h.rendezvous_port.remote())))
        return [h]

    try:
        hs = role()
        losses = call_all(hs, "train", 20)[0]
        assert sum(losses[-5:]) < sum(losses[:5])
        call_all(hs, "save", 20)
        saved = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for s in call_all(hs, "flat_state")]
        call_all(hs, "wait")
        continued = call_all(hs, "train", 2)
        kill_actors(hs)
        for source in ("memory", "disk"):
            if source == "disk":
                hygiene.remove_job("/dev/shm", job)
            hs = role()
            assert call_all(hs, "load") == [{"step": 20, "source": source}]
            state = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                     for s in call_all(hs, "flat_state")]
            assert_states_equal(state, saved)
            assert call_all(hs, "train", 2) == continued
            kill_actors(hs)
    finally:
        finish_job(job, timeout=30)
