"""``dlrover list [--root runs] [--address ADDR] [--no-cluster] [--json]``: the jobs of
a job root (each ``<root>/<dir>/`` holding a run) and the running jobs of the Ray
cluster (their JobMaster actors), one row per job directory (two directories of one
job name are two rows): name, latest run, status, start time, age, steps, restarts,
wall time (s), goodput, error (its first line), and where the row came from.

A job found in both places shows the running master's view. A directory without a
``summary.json`` whose master is not found is ``running`` when the process holding its
run lock (its submit, or the lock keeper of a detached job) is alive on this machine
(its JobMaster is on a Ray cluster this command did not join: several clusters on one
machine), else ``unfinished`` (it runs on another machine's cluster, or its master died
with the cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from dlrover_core.cli.output import console_for, print_json, print_table

COLUMNS = ("name", "run", "status", "started_at", "age_s", "steps", "restarts", "wall_s",
           "goodput", "error", "job_dir", "source")


def tail_lines(path: str, chunk: int = 65536) -> list[str]:
    """The lines of the last ``chunk`` bytes of ``path`` (the first may be cut)."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - chunk))
        return f.read().decode(errors="replace").splitlines()


def _tail_step(path: str, chunk: int = 65536) -> int | None:
    """The highest ``step`` among the last ``chunk`` bytes of a metrics.jsonl."""
    if not os.path.exists(path):
        return None
    steps = []
    for ln in tail_lines(path, chunk):
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


def _first_line(text: Any, width: int | None = None) -> str | None:
    """The first line of ``text`` (``None`` for none), cut to ``width`` characters."""
    if not text:
        return None
    line = str(text).strip().splitlines()[0]
    return line if width is None or len(line) <= width else line[:width - 3] + "..."


def jobs_in_root(root: str) -> list[dict]:
    """One row per job directory under ``root`` (sorted by directory), from its latest
    run (:func:`job_row`)."""
    from dlrover_core.cli.job_files import is_job_dir

    if not os.path.isdir(root):
        return []
    dirs = (os.path.abspath(os.path.join(root, e)) for e in sorted(os.listdir(root)))
    return [job_row(d) for d in dirs if os.path.isdir(d) and is_job_dir(d)]


def job_row(d: str) -> dict:
    """The row of job directory ``d`` (absolute), from its latest run: name, run, status,
    started_at (unix s), steps, restarts, wall_s, goodput, error (its first line),
    job_dir and source."""
    from dlrover_core.cli.job_files import job_name_of
    from dlrover_core.master.dir_lock import live_holder
    from dlrover_core.runs import run_paths

    paths = run_paths(d)
    info = paths.info
    row: dict[str, Any] = {"name": job_name_of(d), "run": paths.run,
                           "status": "unfinished", "started_at": info.get("started_at"),
                           "steps": None, "restarts": None, "wall_s": None,
                           "goodput": None, "error": None, "job_dir": d, "source": d}
    summary = None
    try:
        with open(paths.summary) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        pass
    first = _first_event(paths.events) if os.path.isfile(paths.events) else None
    if row["started_at"] is None and first and first.get("event") == "job_started":
        row["started_at"] = float(first["ts"])
    if summary:
        row.update(status=summary.get("status"), steps=summary.get("steps"),
                   restarts=(summary.get("restarts") or {}).get("total", 0),
                   wall_s=summary.get("wall_s"), goodput=summary.get("goodput"),
                   error=_first_line(summary.get("error")))
        row["started_at"] = summary.get("started_at", row["started_at"])
    else:
        if live_holder(d) is not None:  # its submit (or lock keeper) is alive here
            row["status"] = "running"
            row["source"] = f"{d} (its JobMaster is on a Ray cluster not joined)"
        if first and first.get("event") == "job_started" and os.path.isfile(paths.events):
            row["wall_s"] = round(os.path.getmtime(paths.events) - float(first["ts"]), 3)
        last = _tail_step(paths.metrics)
        row["steps"] = last + 1 if last is not None else 0
    return row


def running_masters(address: str | None) -> dict[str, tuple[Any, dict]] | None:
    """The JobMasters alive on the cluster at ``address`` (``None``: the one on this
    machine, if any): job name -> (actor handle, its ``status()``); ``None`` when there
    is no cluster to join."""
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
    found = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a.get("namespace") != MASTER_NAMESPACE or not a["name"].startswith(prefix):
            continue
        try:
            master = ray.get_actor(a["name"], namespace=MASTER_NAMESPACE)
            st = ray.get(master.status.remote(), timeout=15)
        except Exception:  # noqa: BLE001 - a master that is restarting or gone
            continue
        found[st.get("name", a["name"][len(prefix):])] = (master, st)
    return found


def jobs_on_cluster(address: str | None) -> list[dict] | None:
    """Rows of the JobMasters alive on the cluster at ``address`` (``None``: the one on
    this machine, if any); ``None`` when there is no cluster to join."""
    masters = running_masters(address)
    if masters is None:
        return None
    rows = []
    for name, (_, st) in masters.items():
        summary = st.get("summary") or {}
        rows.append({"name": name, "run": st.get("run"),
                     "status": summary.get("status") or st.get("state"),
                     "started_at": st.get("started_at"),
                     "steps": summary.get("steps", max(st.get("step", -1), -1) + 1),
                     "restarts": (st.get("restarts") or {}).get("total", 0),
                     "wall_s": summary.get("wall_s", round(st.get("elapsed_s", 0.0), 3)),
                     "goodput": summary.get("goodput"),
                     "error": _first_line(summary.get("error") or st.get("error")),
                     "job_dir": st.get("job_dir"), "source": "cluster"})
    return rows


def list_jobs(root: str, address: str | None = None, cluster: bool = True,
              now: float | None = None) -> list[dict]:
    """Rows of :func:`jobs_in_root` and :func:`jobs_on_cluster`, one per job directory
    (a running job's row is its master's view), each with ``age_s``: seconds since its
    latest run started (``now``: unix s, default the current time)."""
    by_dir: dict[str, dict] = {r["job_dir"]: r for r in jobs_in_root(root)}
    live = jobs_on_cluster(address) if cluster else None
    for r in live or []:
        key = os.path.abspath(r["job_dir"]) if r.get("job_dir") else f"cluster:{r['name']}"
        if key in by_dir:
            r = {**r, "job_dir": key, "source": f"cluster, {by_dir[key]['source']}"}
        by_dir[key] = r
    now = time.time() if now is None else now
    rows = sorted(by_dir.values(), key=lambda r: (r["name"], r.get("job_dir") or ""))
    for r in rows:
        r["age_s"] = round(now - r["started_at"], 1) if r.get("started_at") else None
    return rows


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


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
    print_table(("name", "run", "status", "started", "age", "steps", "restarts", "wall (s)",
                 "goodput", "error", "source"),
                ((r["name"], _fmt(r.get("run")), r["status"],
                  time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"]))
                  if r.get("started_at") else "-", _age(r.get("age_s")), _fmt(r["steps"]),
                  _fmt(r["restarts"]), _fmt(r["wall_s"], ".1f"), _fmt(r["goodput"], ".3f"),
                  _first_line(r.get("error"), 40) or "", r["source"])
                 for r in rows), title="dlrover jobs")
    return 0
