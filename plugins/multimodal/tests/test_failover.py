"""Failover of a whole multimodal job (the toy of dlrover_plugin_multimodal.toy) on the
real local Ray cluster: the fusion trainer's process, the driver's or an encoder's is
SIGKILLed from outside mid-run (its pid as the master reports it), and the run must end
exactly where an unkilled run ends.

The toy is deterministic (seeded model, one torch thread, batches from a seeded
permutation, a fixed bag-of-words text encoder), so "exactly" is bit for bit: the
trainer's committed state after the last step (model, optimizer, step, samples, RNG)
and every step's reported metrics, timings and the encoders' work counters aside (a
restart makes the encoders embed the redone steps again: those count work done, not
training). Before the trainer was checkpointed at the driver's commits, a killed
trainer came back at step 0 while the restarted driver resumed there, and every step
before the kill was trained and reported twice; before encoders were replaced under
the running driver (roles.<encoder>.config.failover: replace), a killed encoder
restarted the driver, which rolled the trainer back to its last commit and trained the
steps after it again.
"""

from __future__ import annotations

import json
import os

import pytest

from dlrover_core import DLJobBuilder

TOY = "dlrover_plugin_multimodal.toy"
STEPS = 12            # 3 epochs of 64 samples in batches of 16
EVERY = 4             # checkpoint.every_steps: the driver commits every 4 steps
KILL_AFTER = 3        # kill once the first commit's steps (0-3) were reported


def _job(name: str):
    config = {"multimodal": {
        "data": {"dataset": f"{TOY}:ToyPairs", "modalities": ["vec", "tag"]},
        "encoders": {"vision_encoder": {"modality": "vec", "trainable": True},
                     "text_encoder": {"modality": "tag"}},
        "batch_size": 16, "epochs": 3, "evaluate": True},
        # slow steps leave the kill time to land between two commits
        "toy": {"step_sleep_s": 0.3}}
    return (DLJobBuilder().name(name).dl_type("MULTIMODAL").config(config)
            .checkpoint(every_steps=EVERY)
            .workload("trainer", TOY, "ToyTrainer").resource(cpu=0.3)
            .workload("vision_encoder", TOY, "ToyVecEncoder").resource(cpu=0.3)
            .workload("text_encoder", TOY, "ToyTextEncoder").resource(cpu=0.3)
            .with_collocation("trainer", "vision_encoder")
            .build())


def _rows(job_dir: str) -> list[dict]:
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("role") == "driver"]


def _deterministic(metrics: dict) -> dict:
    """The metrics that neither measure time nor count an encoder's work (nor its
    replacements)."""
    return {k: v for k, v in metrics.items()
            if not (k.endswith("_s") or k in ("ts", "time", "event", "samples_per_s",
                                               "encoders_replaced")
                    or k.startswith(("text_encoder_", "vision_encoder_")))}


def _final_state(job_dir: str) -> dict:
    """The trainer's last committed step, every leaf (DCP files read back whole)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dlrover_core.testing import flatten_state

    step_dir = os.path.join(job_dir, "ckpt", "trainer", f"step_{STEPS:08d}")
    out = os.path.join(job_dir, "final.pt")
    dcp_to_torch_save(step_dir, out)
    return flatten_state(torch.load(out, weights_only=False))


def _run(job_dir: str, kill: str | None) -> dict:
    from dlrover_core.testing import run_killing

    return run_killing(_job(f"mm-fo-{kill or 'none'}").spec, job_dir, kill,
                       at_step=KILL_AFTER, before_step=STEPS - 1)[0]


def _killed_run_ends_as_unkilled(unkilled, job_dir: str, kill: str) -> tuple[dict, list]:
    """Run with ``kill`` SIGKILLed and check what every such run must end with: one
    restart, of the killed role; the samples trained counted once; each step reported
    once with the unkilled run's metrics (loss etc. bit for bit); the final committed
    state the unkilled run's bit for bit. Returns the summary and the events."""
    from dlrover_core.testing import assert_states_equal

    ref_summary, ref_rows, ref_state = unkilled
    summary = _run(job_dir, kill)
    assert summary["restarts"]["total"] == 1
    assert summary["failures"][0]["role"] == kill.split("-")[0]
    m = summary["metrics"]
    assert m["steps"] == STEPS
    assert m["trained_samples"] == STEPS * 16  # exactly once
    assert _deterministic(m) == _deterministic(ref_summary["metrics"])
    rows = [r for r in _rows(job_dir) if "fit_s" not in r]
    # each step reported once (the master logs reports in arrival order: sorted)
    assert sorted(r["step"] for r in rows) == list(range(STEPS))
    ref = {r["step"]: _deterministic(r) for r in ref_rows if "fit_s" not in r}
    assert {r["step"]: _deterministic(r) for r in rows} == ref
    assert_states_equal([_final_state(job_dir)], [ref_state])
    with open(os.path.join(job_dir, "events.jsonl")) as f:
        return summary, [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def unkilled(ray_cluster, tmp_path_factory):
    job_dir = str(tmp_path_factory.mktemp("mm-unkilled"))
    summary = _run(job_dir, None)
    return summary, _rows(job_dir), _final_state(job_dir)


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["trainer-0", "driver"])
def test_killed_trainer_or_driver_ends_bit_for_bit_where_the_unkilled_run_ends(
        unkilled, job_dir, kill):
    """SIGKILL of the fusion trainer (stateful: its replacement is restored to the
    driver's last commit) or of the driver (the trainer, ahead of the commit, is rolled
    back to it): the final committed state equals the unkilled run's bit for bit, each
    step is reported once, in order, with the unkilled run's metrics, and the samples
    trained are counted once."""
    _, events = _killed_run_ends_as_unkilled(unkilled, job_dir, kill)
    started = [e for e in events if e["event"] == "instance_started"
               and e["role"] == kill.split("-")[0]]
    assert [e["attempt"] for e in started] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["text_encoder-0", "vision_encoder-0"])
def test_killed_encoder_is_replaced_under_the_running_driver_and_no_step_is_redone(
        unkilled, job_dir, kill):
    """SIGKILL of a frozen (text) or trainable (vision, collocated with the trainer)
    encoder between two commits: the graph makes it a stateless role, so the master
    replaces that rank alone and the driver keeps running, waits for the replacement and
    retries the step's calls on it. The driver and the trainer each started once (so no
    rollback ran: only a (re)started driver restores the trainer, and the trainer takes
    steps strictly in order), each step is reported once with the unkilled run's metrics,
    the final committed state is the unkilled run's bit for bit and the samples trained
    are counted once. On the code before, the driver restarted (its attempts were [0, 1])
    and retrained the steps after the last commit."""
    summary, events = _killed_run_ends_as_unkilled(unkilled, job_dir, kill)
    role = kill.split("-")[0]
    assert summary["restarts"]["process"] == 1
    # the driver's call was retried on the replacement
    assert summary["metrics"]["encoders_replaced"] == 1
    started: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        if e["event"] == "instance_started":
            started.setdefault(e["role"], []).append((e["attempt"], e["pid"]))
    assert [a for a, _ in started[role]] == [0, 1]
    # the driver and the trainer were never restarted: one process each, the same pid
    assert [a for a, _ in started["driver"]] == [0]
    assert [a for a, _ in started["trainer"]] == [0]
    other = "vision_encoder" if role == "text_encoder" else "text_encoder"
    assert [a for a, _ in started[other]] == [0]
    rec = [e for e in events if e["event"] == "recovery_started"]
    assert len(rec) == 1 and rec[0]["restart_driver"] is False
    scope = rec[0]["scope"]
    assert scope["restart"] == [kill] and scope["rollback"] == []
    assert scope["retry"] == [f"driver -> {role}"]
    assert f"{role} is stateless" in scope["why"]
