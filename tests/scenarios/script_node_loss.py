"""Scenario: a script role (a tiny plain torchrun script, no dlrover import) runs 2 ranks,
one per worker node of a ``ray.cluster_utils.Cluster``; once the script has saved its
first snapshot, the node of rank 1 is removed. Run as
``python -m tests.scenarios.script_node_loss JOB_DIR WORK_DIR MODE``; MODE is ``fixed``
(3 worker nodes: the role is re-placed at 2 ranks on the nodes left) or ``elastic`` (2
worker nodes, ``roles.trainer.nodes: "1:2"``: the role shrinks to 1 rank). Prints one
JSON line: the summary plus what the scenario saw."""

from __future__ import annotations

import json
import os
import sys
import time

from dlrover_core import load_spec
from dlrover_core.testing import multinode_cluster, run_job

STEPS, SAVE_EVERY, STEP_SLEEP = 60, 20, 0.1

#: The role's script: a linear regression under DDP over gloo that saves its own
#: snapshot (rank 0, every --save-every steps) and resumes from it. Every batch is a
#: function of (step, rank), so ``reference(steps, world)`` (one process, the ranks'
#: batches concatenated) is the uninterrupted run's loss.
SCRIPT = r'''
import json, os, sys, time

import torch
import torch.distributed as dist
import torch.nn.functional as F

W = torch.tensor([[1.0], [-2.0], [3.0], [0.5]])


def batch(step, rank):
    g = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(16, 4, generator=g)
    return x, x @ W + 0.25


def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def reference(steps, world):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(steps):
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        loss = F.mse_loss(m(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def main(steps, save_every, snapshot, out, sleep):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    m = torch.nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    start = 0
    if os.path.exists(snapshot):
        snap = torch.load(snapshot, weights_only=True)
        m.module.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        start = snap["step"]
    with open(out + ".starts", "a") as f:
        f.write(json.dumps({"rank": rank, "world_size": world, "restart_count": restart,
                            "resumed_from": start, "pid": os.getpid()}) + "\n")
    for step in range(start, steps):
        x, y = batch(step, rank)
        loss = F.mse_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(sleep)
        done = step + 1
        if rank == 0 and done % save_every == 0 and done < steps:
            tmp = snapshot + ".tmp"
            torch.save({"model": m.module.state_dict(), "optimizer": opt.state_dict(),
                        "step": done}, tmp)
            os.replace(tmp, snapshot)
            print("saved step", done, flush=True)
        dist.barrier()
    t = torch.tensor([loss.item()])  # a snapshot is never of the last step
    dist.all_reduce(t)  # the mean of the ranks' last-step losses: the global batch's loss
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": steps, "final_loss": t.item() / world, "world_size": world,
                       "restart_count": restart, "resumed_from": start}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--reference":
        print(json.dumps({"final_loss": reference(int(sys.argv[2]), int(sys.argv[3]))}))
    else:
        steps, save_every, snapshot, out, sleep = sys.argv[1:6]
        main(int(steps), int(save_every), snapshot, out, float(sleep))
'''


def spec_for(work: str, mode: str):
    """The job spec: role ``trainer`` runs the script, 2 ranks, 1 per node."""
    role = {"command": f"tiny_train.py {STEPS} {SAVE_EVERY} {work}/snap.pt "
                       f"{work}/out.json {STEP_SLEEP}",
            "working_dir": work, "total": 2, "per_node": 1, "resources": {"cpu": 1}}
    if mode == "elastic":
        role["nodes"] = "1:2"
    return load_spec({
        "name": f"script-node-{mode}", "roles": {"trainer": role},
        "failover": {"max_restarts": 3, "survivor_grace_s": 3, "pg_timeout_s": 60,
                     "standby": False},
        "elastic": {"replacement_timeout_s": 2, "poll_interval_s": 3600},
    })


def main(job_dir: str, work: str, mode: str) -> None:
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "tiny_train.py"), "w") as f:
        f.write(SCRIPT)
    seen: dict = {"removed": None, "ranks_at_removal": None}
    workers = 3 if mode == "fixed" else 2
    with multinode_cluster(workers=workers, cpus=1) as (cluster, nodes):

        def remove_rank1_node(st: dict) -> None:
            if seen["removed"] is not None or not os.path.exists(f"{work}/snap.pt"):
                return
            inst = st["instances"]
            seen["ranks_at_removal"] = {k: v["node_id"] for k, v in inst.items()}
            seen["removed"] = inst["trainer-1"]["node_id"]
            seen["removed_at"] = time.time()
            cluster.remove_node(nodes[seen["removed"]])

        summary = run_job(spec_for(work, mode), job_dir, remove_rank1_node, timeout=360,
                          interval=0.2)
        print(json.dumps({"summary": summary, **seen, "worker_nodes": sorted(nodes)}))
        sys.stdout.flush()


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2]), sys.argv[3])
