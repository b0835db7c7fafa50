"""Build and submit the guide-style RL example with ``DLJobBuilder``, as seed 004's
"Use API for Submit" step does. ``python -m examples.guide_rl.run [iterations]``."""

from __future__ import annotations

import json
import sys

from dlrover_core import DLJobBuilder


def build(iterations: int = 150):
    return (
        DLJobBuilder()
        .dl_type("RL")
        .node_num(1)
        .config({"iterations": iterations, "batch_size": 64, "lr": 0.05, "kl_coef": 0.01,
                 "shift": 3, "seed": 0})
        .trainer("examples.guide_rl.trainer", "UserTrainer")
        .actor("examples.guide_rl.workload", "UserActorModel").total(1).per_node(1)
        .resource(cpu=0.5)
        .rollout("examples.guide_rl.workload", "UserRolloutModel").total(2).per_node(2)
        .resource(cpu=0.25)
        .reference("examples.guide_rl.workload", "UserReferenceModel").total(1).per_node(1)
        .resource(cpu=0.25)
        .reward("examples.guide_rl.workload", "UserRewardModel").total(1).per_node(1)
        .resource(cpu=0.25)
        .build())


def main() -> None:
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    dl_job = build(iterations)
    summary = dl_job.submit(progress=True)
    print(json.dumps({"job": dl_job.name, "status": summary["status"],
                      "mean_reward": summary["metrics"].get("mean_reward"),
                      "wall_s": summary.get("wall_s")}))
    sys.exit(0 if summary["status"] == "succeeded" else 1)


if __name__ == "__main__":
    main()
