"""Scenario: an elastic script role (``roles.trainer.nodes: "1:2"``, the YAML form of
``dlrover-run --nnodes 1:2``) shrinks when a node is lost and grows back when one joins.
A tiny torchrun script (DDP over gloo, its own snapshot; it tells the master of each
snapshot with ``dlrover_core.script_api.report_checkpoint`` and of each step with
``report_step``) runs 2 ranks, one per worker node of a ``ray.cluster_utils.Cluster``:

1. after the first snapshot the node of rank 1 is removed: the role shrinks to 1 rank;
2. once it has shrunk, a worker node is added (``cluster.add_node``);
3. once the master saw room (its ``elastic_room`` event) the scenario lets the 1-rank
   script go on (it waits at its first snapshot at world size 1 until then, so the
   run cannot end before the grow on a slow machine); at its next snapshot the role is
   restarted at 2 ranks, which resume from that snapshot and run to the last step.

Run as ``python -m tests.scenarios.script_grow JOB_DIR WORK_DIR``; prints one JSON line:
the summary plus what the scenario saw."""

from __future__ import annotations

import json
import os
import sys
import time

from dlrover_core import load_spec
from dlrover_core.master.events import read_events
from dlrover_core.runs import run_paths
from dlrover_core.testing import multinode_cluster, run_job

STEPS, SAVE_EVERY, STEP_SLEEP = 60, 10, 0.1

SCRIPT = r'''
import json, os, sys, time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlrover_core.script_api import report_checkpoint, report_step

W = torch.tensor([[1.0], [-2.0], [3.0], [0.5]])


def main(steps, save_every, work, sleep):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    snapshot, start = os.path.join(work, "snap.pt"), 0
    if os.path.exists(snapshot):
        snap = torch.load(snapshot, weights_only=True)
        m.module.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        start = snap["step"]
    with open(os.path.join(work, "starts.jsonl"), "a") as f:
        f.write(json.dumps({"rank": rank, "world_size": world, "resumed_from": start}) + "\n")
    waited = False
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step * 1009 + rank)
        x = torch.randn(16, 4, generator=g)
        loss = F.mse_loss(m(x), x @ W + 0.25)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(sleep)
        report_step(step, samples=16, loss=loss.item())
        done = step + 1
        if rank == 0 and done % save_every == 0 and done < steps:
            torch.save({"model": m.module.state_dict(), "optimizer": opt.state_dict(),
                        "step": done}, snapshot + ".tmp")
            os.replace(snapshot + ".tmp", snapshot)
            report_checkpoint(done)
            print("saved step", done, flush=True)
            if world == 1 and not waited:  # hold the 1-rank run until a node joined
                waited, deadline = True, time.time() + 300
                while not os.path.exists(os.path.join(work, "room")):
                    if time.time() > deadline:
                        sys.exit("no room seen within 300 s")
                    time.sleep(0.1)
        dist.barrier()
    if rank == 0:
        with open(os.path.join(work, "out.json"), "w") as f:
            json.dump({"steps": steps, "world_size": world, "resumed_from": start}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
'''


def spec_for(work: str):
    role = {"command": f"grow_train.py {STEPS} {SAVE_EVERY} {work} {STEP_SLEEP}",
            "working_dir": work, "total": 2, "per_node": 1, "resources": {"cpu": 1},
            "nodes": "1:2"}
    return load_spec({
        "name": "script-grow", "roles": {"trainer": role},
        "failover": {"max_restarts": 4, "survivor_grace_s": 3, "pg_timeout_s": 60,
                     "standby": False},
        "elastic": {"replacement_timeout_s": 2, "poll_interval_s": 1},
    })


def main(job_dir: str, work: str) -> None:
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "grow_train.py"), "w") as f:
        f.write(SCRIPT)
    seen: dict = {"removed": None, "added": None, "room_at": None}
    with multinode_cluster(workers=2, cpus=1) as (cluster, nodes):

        def events(name: str) -> list[dict]:
            try:
                return [e for e in read_events(run_paths(job_dir).events)
                        if e.get("event") == name]
            except (FileNotFoundError, ValueError):
                return []

        def drive(st: dict) -> None:
            if seen["removed"] is None:
                # the first checkpoint is saved and the master has rank 0's steps before
                # it (a process ended before its report_step join is done loses the
                # reports made meanwhile; see dlrover_core.script_api)
                if (os.path.exists(f"{work}/snap.pt") and "trainer-1" in st["instances"]
                        and st.get("step", -1) >= SAVE_EVERY - 1):
                    seen["removed"] = st["instances"]["trainer-1"]["node_id"]
                    cluster.remove_node(nodes[seen["removed"]])
            elif seen["added"] is None:
                if any(e.get("world_size") == 1 for e in events("elastic_resized")):
                    seen["added"] = cluster.add_node(num_cpus=1).node_id
            elif seen["room_at"] is None and events("elastic_room"):
                seen["room_at"] = time.time()
                open(os.path.join(work, "room"), "w").close()

        summary = run_job(spec_for(work), job_dir, drive, timeout=420, interval=0.2)
        print(json.dumps({"summary": summary, **seen}))
        sys.stdout.flush()


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]))
