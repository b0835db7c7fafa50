"""Run both stages of the example with ``dlrover submit`` and print one JSON line.

    python -m examples.grpo_arith.run            # from the repository root
    python -m examples.grpo_arith.run --sft-steps 375 --iterations 80

The line holds the SFT accuracy, the GRPO accuracy before and after, the number of
held-out problems and each stage's wall time (from the two ``summary.json`` files).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def submit(job: str, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "dlrover_core.cli.main", "submit", os.path.join(HERE, job),
           "--no-progress", *overrides]
    print("$ dlrover", " ".join(cmd[3:]), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    name = {"sft.yaml": "grpo-arith-sft", "grpo.yaml": "grpo-arith"}[job]
    with open(os.path.join("runs", name, "summary.json")) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=None)
    p.add_argument("--iterations", type=int, default=None)
    args = p.parse_args()
    sft = submit("sft.yaml", [f"config.sft.steps={args.sft_steps}"] if args.sft_steps else [])
    grpo = submit("grpo.yaml",
                  [f"config.rl.iterations={args.iterations}"] if args.iterations else [])
    m = grpo["metrics"]
    print(json.dumps({
        "sft_accuracy": sft["metrics"].get("accuracy"),
        "accuracy_before": m.get("accuracy_before"), "accuracy_after": m.get("accuracy_after"),
        "eval_problems": m.get("eval_problems_after"), "grpo_iterations": m.get("iterations"),
        "sft_wall_s": sft["wall_s"], "grpo_wall_s": grpo["wall_s"],
        "status": [sft["status"], grpo["status"]]}))
    return 0 if grpo["status"] == "succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
