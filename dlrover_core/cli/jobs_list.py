"""``dlrover list [--root runs] [--address ADDR] [--no-cluster] [--json]``: the jobs of
a job root (each ``<root>/<name>/`` with an ``events.jsonl``) and the running jobs of
the Ray cluster (their JobMaster actors), one row per job: name, status, steps,
restarts, wall time (s), goodput, and where the row came from.

A job found in both places shows the running master's view. A directory without a
``summary.json`` whose master is not found is ``unfinished`` (it runs on a cluster
this command did not join, or its master died with the cluster).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from dlrover_core.cli.job_files import EVENTS, METRICS, SUMMARY
from dlrover_core.cli.output import console_for, print_json, print_table

COLUMNS = ("name", "status", "steps", "restarts", "wall_s", "goodput", "source")


def _tail_step(path: str, chunk: int = 65536) -> int | None:
    """The highest ``step`` among the last ``chunk`` bytes of a metrics.jsonl."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - chunk))
        lines = f.read().decode(errors="replace").splitlines()
    steps = []
    for ln in lines:
        try:
            steps.append(int(json.loads(ln)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(steps) if steps else None


def _first_event(path: str) -> dict | None:
    with open(path) as f:
        for ln in f:
            try:
                return json.loads(ln)
            except ValueError:
                continue
    return None


def jobs_in_root(root: str) -> list[dict]:
    """One row per job directory under ``root`` (sorted by name)."""
    rows = []
    if not os.path.isdir(root):
        return rows
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        events = os.path.join(d, EVENTS)
        if not os.path.isfile(events):
            continue
        row: dict[str, Any] = {"name": name, "status": "unfinished", "steps": None,
                               "restarts": None, "wall_s": None, "goodput": None,
                               "source": os.path.abspath(d)}
        summary = None
        try:
            with open(os.path.join(d, SUMMARY)) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            pass
        if summary:
            row.update(name=summary.get("name", name), status=summary.get("status"),
                       steps=summary.get("steps"),
                       restarts=(summary.get("restarts") or {}).get("total", 0),
                       wall_s=summary.get("wall_s"), goodput=summary.get("goodput"))
        else:
            first = _first_event(events)
            if first and first.get("event") == "job_started":
                row["name"] = first.get("job", name)
                row["wall_s"] = round(os.path.getmtime(events) - float(first["ts"]), 3)
            last = _tail_step(os.path.join(d, METRICS))
            row["steps"] = last + 1 if last is not None else 0
        rows.append(row)
    return rows


def jobs_on_cluster(address: str | None) -> list[dict] | None:
    """Rows of the JobMasters alive on the cluster at ``address`` (``None``: the one on
    this machine, if any); ``None`` when there is no cluster to join."""
    from dlrover_core.master.client import init_ray
    from dlrover_core.master.ray_auth import ClusterAuthError

    try:
        init_ray(address or "auto")
    except ClusterAuthError:
        raise
    except (ConnectionError, RuntimeError, ValueError):
        return None
    import ray

    from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name

    prefix = master_actor_name("")
    rows = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") != MASTER_NAMESPACE or not a["name"].startswith(prefix):
            continue
        try:
            master = ray.get_actor(a["name"], namespace=MASTER_NAMESPACE)
            st = ray.get(master.status.remote(), timeout=15)
        except Exception:  # noqa: BLE001 - a master that is restarting or gone
            continue
        summary = st.get("summary") or {}
        rows.append({"name": st.get("name", a["name"][len(prefix):]),
                     "status": summary.get("status") or st.get("state"),
                     "steps": summary.get("steps", max(st.get("step", -1), -1) + 1),
                     "restarts": (st.get("restarts") or {}).get("total", 0),
                     "wall_s": summary.get("wall_s", round(st.get("elapsed_s", 0.0), 3)),
                     "goodput": summary.get("goodput"), "source": "cluster"})
    return rows


def list_jobs(root: str, address: str | None = None, cluster: bool = True) -> list[dict]:
    """Rows of :func:`jobs_in_root` merged with :func:`jobs_on_cluster` by name."""
    by_name = {r["name"]: r for r in jobs_in_root(root)}
    live = jobs_on_cluster(address) if cluster else None
    for r in live or []:
        if r["name"] in by_name:
            r = {**r, "source": f"cluster, {by_name[r['name']]['source']}"}
        by_name[r["name"]] = r
    return sorted(by_name.values(), key=lambda r: r["name"])


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="jobs of a job root and of the connected Ray cluster")
    p.add_argument("--root", default="runs", help="job root to scan (default: runs)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to ask for running jobs (default: the one on this "
                        "machine, if any)")
    p.add_argument("--no-cluster", action="store_true", help="only the job root")
    p.add_argument("--json", action="store_true", help="a JSON list of rows")
    p.set_defaults(func=cmd_list)


def _fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def cmd_list(args: argparse.Namespace) -> int:
    rows = list_jobs(args.root, args.address, cluster=not args.no_cluster)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        console_for(stderr=True).print(f"no jobs in {os.path.abspath(args.root)}"
                                       + ("" if args.no_cluster else " or on the cluster"))
        return 0
    print_table(("name", "status", "steps", "restarts", "wall (s)", "goodput", "source"),
                ((r["name"], r["status"], _fmt(r["steps"]), _fmt(r["restarts"]),
                  _fmt(r["wall_s"], ".1f"), _fmt(r["goodput"], ".3f"), r["source"])
                 for r in rows), title="dlrover jobs")
    return 0
