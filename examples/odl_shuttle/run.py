"""Run the Shuttle online-learning job and compare it with offline training.

    python -m examples.odl_shuttle.run [--redis] [--limit N] [key=value ...]

1. streams the dataset through the ``odl`` job of ``job.yaml`` (``--redis``: first
   writes it into a Redis stream of a private ``redis-server`` started here, and
   the job reads it through the ``redis`` source);
2. prints the prequential accuracy over time (test-then-train: every record is
   scored by the model before the model trains on it) beside the no-change and
   majority-class baselines scored the same way;
3. trains the same model offline, in one pass over the shuffled first half, and
   scores it on the second half, beside the online model's prequential accuracy
   and the baselines' on that same second half;
4. takes ``lost`` and ``duplicated`` from the job's ``summary.json`` (the driver
   counts them from the records the source handed out and the trainer trained),
   checks ``lost_vs_data_set``: records of the data set the trainer never trained
   (what a broker never handed to the source included), and prints one JSON
   summary line (no throughput: ``benchmarks/odl_stream.py`` measures that).

The job directory (``runs/odl-shuttle``, or ``--job-dir``) is removed first, so the
stream starts from its beginning.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from dlrover_plugin_odl.ledger import trained_ids

HERE = os.path.dirname(os.path.abspath(__file__))


def _driver_rows(job_dir: str) -> list[dict]:
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r.get("role") == "driver" and "records" in r]


def offline_one_pass(records: list[dict], lr: float, hidden: int, batch_size: int,
                     seed: int = 0) -> tuple[float, float]:
    """Train ``build_model`` in one pass over the shuffled first half; return its
    accuracy on the second half and the majority-class accuracy there."""
    import torch

    from examples.odl_shuttle.workload import build_model, features

    torch.manual_seed(seed)
    half = len(records) // 2
    train, test = records[:half], records[half:]
    x = features([r["x"] for r in train])
    y = torch.tensor([r["y"] for r in train])
    model = build_model(hidden)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for idx in torch.randperm(len(train)).split(batch_size):
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        xt = features([r["x"] for r in test])
        yt = torch.tensor([r["y"] for r in test])
        acc = float((model(xt).argmax(-1) == yt).float().mean())
    majority = float((yt == yt.mode().values).float().mean())
    return acc, majority


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--redis", action="store_true",
                   help="stream through Redis Streams (starts a private redis-server)")
    p.add_argument("--limit", type=int, default=0, help="first N records only (0: all 49,097)")
    p.add_argument("--job-dir", default=None)
    p.add_argument("overrides", nargs="*", help="job spec overrides, key=value")
    args = p.parse_args(argv)

    from omegaconf import OmegaConf

    from dlrover_core import load_spec
    from dlrover_core.master.client import submit_job
    from examples.odl_shuttle.data import shuttle_records

    raw = OmegaConf.load(os.path.join(HERE, "job.yaml"))
    raw.config.odl.source.options.kwargs.limit = args.limit
    order = raw.config.odl.source.options.kwargs.order
    records = list(shuttle_records(args.limit, order))
    server = None
    if args.redis:
        from dlrover_plugin_odl.redis_server import LocalRedisServer
        from dlrover_plugin_odl.redis_source import produce

        server = LocalRedisServer().start()
        produce(server.client(), "shuttle", records)
        print(f"redis-server on {server.address}: {len(records)} records in stream 'shuttle'")
        raw.config.odl.source = {"kind": "redis",
                                 "options": {"port": server.port, "stream": "shuttle"}}
        raw.config.odl.max_records = len(records)
    try:
        spec = load_spec(raw, args.overrides)
        job_dir = os.path.abspath(args.job_dir or os.path.join("runs", spec.name))
        shutil.rmtree(job_dir, ignore_errors=True)
        summary = submit_job(spec, job_dir=job_dir, progress=False)
    finally:
        if server is not None:
            server.cleanup()
    if summary["status"] != "succeeded":
        print(f"job {summary['status']}: {summary.get('error')}", file=sys.stderr)
        return 1

    rows = _driver_rows(job_dir)
    n = len(records)
    print(f"\nprequential accuracy over time ({n} records, "
          f"{'redis' if args.redis else 'replay'} source):")
    print(f"{'records':>8} {'cumulative':>11} {'last 2000':>10} {'eval (published)':>17} "
          f"{'no-change':>10} {'majority':>9} {'kappa':>7} {'kappa_t':>8}")
    marks = [n * k // 10 for k in range(1, 11)]
    for r in rows:
        if marks and r["records"] >= marks[0]:
            while marks and r["records"] >= marks[0]:
                marks.pop(0)
            ev = f"{r['eval_accuracy']:.4f} v{int(r['eval_version'])}" \
                if "eval_accuracy" in r else "-"
            print(f"{int(r['records']):>8} {r['prequential_accuracy']:>11.4f} "
                  f"{r['window_accuracy']:>10.4f} {ev:>17} "
                  f"{r['baseline_no_change_accuracy']:>10.4f} "
                  f"{r['baseline_majority_accuracy']:>9.4f} {r['kappa']:>7.4f} "
                  f"{r['kappa_temporal']:>8.4f}")

    m = summary["metrics"]
    # the online model's prequential accuracy on the second half, from the reports
    # nearest the middle and the end
    mid = min(rows, key=lambda r: abs(r["records"] - n // 2))

    def second_half(key: str) -> float:
        return (m[key] * m["records"] - mid[key] * mid["records"]) / \
            max(m["records"] - mid["records"], 1)

    cfg = spec.config
    offline_2nd, majority = offline_one_pass(records, float(cfg.lr), int(cfg.hidden),
                                             int(cfg.odl.batch_size), int(cfg.seed))
    ids = trained_ids(job_dir)
    out = {"source": "redis" if args.redis else "replay",
           "records": int(m["records"]), "lost": int(m["lost"]),
           "duplicated": int(m["duplicated"]),
           "lost_vs_data_set": sum(1 for r in records if str(r["id"]) not in ids),
           **{k: round(m[k], 4) for k in (
               "prequential_accuracy", "kappa", "kappa_temporal",
               "baseline_no_change_accuracy", "baseline_majority_accuracy")},
           "second_half_from_record": int(mid["records"]),
           "online_prequential_accuracy_2nd_half": round(
               second_half("prequential_accuracy"), 4),
           "baseline_no_change_accuracy_2nd_half": round(
               second_half("baseline_no_change_accuracy"), 4),
           "baseline_majority_accuracy_2nd_half": round(
               second_half("baseline_majority_accuracy"), 4),
           "offline_one_pass_accuracy_2nd_half": round(offline_2nd, 4),
           "majority_class_accuracy_2nd_half": round(majority, 4),
           "eval_accuracy": round(m.get("eval_accuracy", float("nan")), 4),
           "published_version": int(m["published_version"])}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
