"""Scenario: a warm standby on a one-GPU node. A one-node Ray cluster declares 1 GPU
(``num_gpus=1``: a Ray resource only; this machine has no GPU, so the workload, the
nanoGPT example on FSDP2, computes on the CPU: CUDA is not available in the process).
A one-rank job asks for that GPU; its spare cannot get one, so it warms up without it.
The rank holds before step 20 (``config.pause``) until the spare is warm, trains on
and is SIGKILLed two steps later; the spare is promoted and takes the rank's GPU. Run
as ``python -m tests.scenarios.gpu_standby JOB_DIR``; prints one JSON line: the
summary, the killed pid and the job's events."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

import ray

from dlrover_core import load_spec
from dlrover_core.master.client import create_master
from dlrover_core.master.events import read_events
from dlrover_core.testing import poll_status, start_test_ray

SPEC = ["name=gpu-standby", "roles.trainer.total=1", "roles.trainer.per_node=1",
        "roles.trainer.resources.gpu=1", "failover.standby=true",
        "config.n_layer=1", "config.n_embd=32", "config.n_head=2", "config.block_size=32",
        "config.batch_size=8", "config.eval_batches=1", "config.lr=1e-2",
        "config.warmup_steps=2", "checkpoint.every_steps=4", "config.max_steps=100",
        "config.eval_every=100", "failover.pg_timeout_s=30"]
#: the rank holds before this step (config.pause) until its spare is warm
PAUSE_AT = 20


def main(job_dir: str) -> None:
    temp_dir = start_test_ray(num_cpus=4, num_gpus=1)
    try:
        go = os.path.join(job_dir, "go")
        pause = f"+config.pause={{step: {PAUSE_AT}, until: '{go}'}}"
        master = create_master(load_spec("examples/nanogpt/job.yaml", [*SPEC, pause]),
                               job_dir)
        ray.get(master.start.remote())
        st = poll_status(master, lambda st: st["summary"] or (
            st["standby"].get("trainer") and st["step"] >= 5), timeout=180)
        open(go, "w").close()  # the spare is warm: train on, and be killed mid-run
        st = poll_status(master, lambda st: st["summary"] or st["step"] >= PAUSE_AT + 2,
                         timeout=120)
        if st["summary"]:
            raise RuntimeError(f"the job ended before its rank was killed: {st}")
        killed = st["instances"]["trainer-0"]["pid"]
        os.kill(killed, signal.SIGKILL)
        summary = poll_status(master, lambda st: st["summary"], 240)["summary"]
        ray.kill(master, no_restart=True)
        time.sleep(0.5)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(json.dumps({"summary": summary, "killed": killed,
                      "events": read_events(os.path.join(job_dir, "events.jsonl"))},
                     default=str))


if __name__ == "__main__":
    main(sys.argv[1])
