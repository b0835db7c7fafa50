"""Throughput of an ``odl`` stream against the same prequential loop in one process.

    .venv/bin/python benchmarks/odl_stream.py [--records 0] [--runs 3]

Records: the first ``--records`` of the Shuttle stream (``examples/odl_shuttle``,
river's bundled copy, time order; 0, the default: all 49,097). Per run, in this
order on one local Ray cluster:

- ``single_process``: a plain loop here: read 64 records, preprocess (signed log),
  score, one Adam step; the same model, batch and learning rate as the job (the
  records are in memory before the clock starts; no checkpoint, no eval).
- ``odl``: the ``examples/odl_shuttle/job.yaml`` job (source, 2 preprocess workers,
  trainer, eval; chunks of ``chunk_batches`` batches of 64; a disk checkpoint
  (``async_save``: committed in the background) and a published version every 50
  steps) streaming the same records; its
  ``records_per_s`` (records trained / seconds of the driver's loop: actor start
  and the source's opening excluded, every checkpoint and publish included), and
  ``job_wall_s`` (the whole job).

The last line is one JSON object: medians and (min, max) over the runs, and
``ratio`` = odl / single_process records/s per run (median and spread). The machine
is shared; compare figures within one run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def single_process(records: list[dict], lr: float, hidden: int, batch: int) -> float:
    """Prequential loop in this process; returns records/s."""
    import torch

    from examples.odl_shuttle.workload import build_model, features

    torch.manual_seed(0)
    model = build_model(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    correct = 0
    t0 = time.perf_counter()
    for i in range(0, len(records), batch):
        chunk = records[i:i + batch]
        x = features([r["x"] for r in chunk])
        y = torch.tensor([r["y"] for r in chunk])
        with torch.no_grad():
            correct += int((model(x).argmax(-1) == y).sum())
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return len(records) / (time.perf_counter() - t0)


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=0, help="0: the whole stream")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()

    import torch
    from omegaconf import OmegaConf

    from dlrover_core import load_spec
    from dlrover_core.master.client import init_ray, submit_job
    from examples.odl_shuttle.data import shuttle_records

    torch.set_num_threads(1)
    records = list(shuttle_records(args.records))
    temp = tempfile.mkdtemp(prefix="dlrb", dir="/tmp")
    init_ray(None, _temp_dir=temp)
    raw = OmegaConf.load("examples/odl_shuttle/job.yaml")
    raw.config.odl.source.options.kwargs.limit = args.records
    raw.config.odl.log_record_ids = False
    runs = []
    try:
        for k in range(args.runs):
            base = single_process(records, float(raw.config.lr), int(raw.config.hidden),
                                  int(raw.config.odl.batch_size))
            spec = load_spec(raw, [f"name=odl-bench-{k}"])
            job_dir = os.path.join(temp, f"job{k}")
            summary = submit_job(spec, job_dir=job_dir, progress=False)
            if summary["status"] != "succeeded":
                print(f"run {k}: job {summary['status']}: {summary.get('error')}",
                      file=sys.stderr)
                return 1
            m = summary["metrics"]
            runs.append({"single_process_records_per_s": round(base, 1),
                         "odl_records_per_s": round(m["records_per_s"], 1),
                         "ratio": round(m["records_per_s"] / base, 4),
                         "job_wall_s": round(summary["wall_s"], 1),
                         "records": int(m["records"])})
            print(json.dumps({"run": k, **runs[-1]}), file=sys.stderr)
    finally:
        import ray

        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    odl = raw.config.odl
    out = {"benchmark": "odl_stream", "records": len(records), "runs": len(runs),
           "batch_size": int(odl.batch_size), "chunk_batches": int(odl.get("chunk_batches", 1)),
           "checkpoint_every_steps": int(raw.checkpoint.every_steps),
           "odl_records_per_s": spread([r["odl_records_per_s"] for r in runs]),
           "single_process_records_per_s": spread([r["single_process_records_per_s"]
                                                   for r in runs]),
           "ratio": {"median": round(statistics.median(r["ratio"] for r in runs), 4),
                     "min": min(r["ratio"] for r in runs), "max": max(r["ratio"] for r in runs)},
           "job_wall_s": spread([r["job_wall_s"] for r in runs])}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
