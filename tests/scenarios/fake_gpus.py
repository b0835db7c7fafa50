"""Scenario: GPUs from the job spec, on a one-node Ray cluster that declares 4 GPUs
(``num_gpus=4``: Ray resources only; this machine has no GPU, so CUDA itself is not
exercised). Runs seed 004's "Use API for Submit" program (``node_num(1)``,
``device_per_node(4)``, no job name) and the SPMD, Ray-assigned, collocated and
separated layouts and two node slots of one role on one node with
``tests.device_probe``; each layout's ``instance_started`` events come back too. Run as
``python -m tests.scenarios.fake_gpus ROOT``; prints one JSON line
``{layout: {"status": ..., "probes": [...], "started": [...]}}``."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys

import ray

from dlrover_core import DLJobBuilder
from dlrover_core.master.events import read_events
from dlrover_core.testing import start_test_ray

P = "tests.device_probe"


def layouts() -> dict:
    def base():
        return DLJobBuilder().dl_type("SFT").node_num(1).device_per_node(4)

    return {
        # the guide's program, with its workload and trainer (tests/guide_programs.py)
        "guide": (DLJobBuilder().dl_type("SFT").node_num(1).device_per_node(4)
                  .config({"k1": "v1"})
                  .trainer("tests.guide_programs", "UserTrainer")
                  .workload("tests.guide_programs", "UserActorModel").total(4).per_node(4)
                  .resource(cpu=0.25)),
        "spmd": base().workload("trainer", P, "DeviceProbe").total(4).per_node(4)
                      .resource(cpu=0.25),
        "spmd_ray_visible": base().workload("trainer", P, "DeviceProbe").total(4).per_node(4)
                                  .resource(cpu=0.25).enable_ray_auto_visible_device(),
        "collocated": base().workload("trainer", P, "DeviceProbe").total(4).per_node(4)
                            .resource(cpu=0.25)
                            .workload("eval", P, "DeviceProbe").total(4).per_node(4)
                            .resource(cpu=0.25)
                            .with_collocation("trainer", "eval"),
        "separated": base().workload("trainer", P, "DeviceProbe").total(2).per_node(2)
                           .resource(cpu=0.25)
                           .workload("eval", P, "DeviceProbe").total(2).per_node(2)
                           .resource(cpu=0.25),
        # one role, two node slots of 2 on the one node: local_rank 0,1,0,1
        "two_slots": DLJobBuilder().dl_type("SFT").device_per_node(4)
                                   .workload("trainer", P, "DeviceProbe").total(4).per_node(2)
                                   .resource(cpu=0.25),
    }


def main(root: str) -> None:
    temp_dir = start_test_ray(num_cpus=8, num_gpus=4)
    out = {}
    try:
        for layout, builder in layouts().items():
            job = builder.build()
            job_dir = os.path.join(root, layout)
            summary = job.submit(job_dir=job_dir)
            probes = [json.load(open(p)) for p in
                      sorted(glob.glob(os.path.join(job_dir, "probe", "*.json")))]
            fit = os.path.join(job_dir, "guide_fit.json")
            started = [e for e in read_events(os.path.join(job_dir, "events.jsonl"))
                       if e["event"] == "instance_started"]
            out[layout] = {"status": summary["status"], "error": summary.get("error"),
                           "name": job.name, "probes": probes, "started": started,
                           "fit": json.load(open(fit)) if os.path.exists(fit) else None}
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
