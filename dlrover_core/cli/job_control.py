"""``dlrover status``, ``stop`` and ``delete``: find a job by the one rule of
:func:`dlrover_core.cli.job_files.find_job` and act on its JobMaster or directory."""

from __future__ import annotations

import argparse
import os

from dlrover_core.cli.output import err, format_restarts, print_json


def _pm():
    from dlrover_core.plugins.manager import get_plugin_manager

    return get_plugin_manager()


def _connect(address: str | None) -> bool:
    """Join the Ray cluster a job runs on (``auto``: the one on this machine)."""
    from dlrover_core.master.client import init_ray
    from dlrover_core.master.ray_auth import ClusterAuthError

    try:
        init_ray(address or "auto")
        return True
    except ClusterAuthError:
        raise
    except (ConnectionError, RuntimeError, ValueError):
        return False


def _find_running(args: argparse.Namespace, connect: bool = True):
    """The job that ``args.name`` (``--job-dir``) names, by the one rule of
    :func:`dlrover_core.cli.job_files.find_job` over the job directories under ``runs/``
    and the running jobs of the cluster; returns ``(JobRef or None, master or None,
    its status or None)``. Without a job directory, a running job of that name counts.

    Raises:
        FileNotFoundError, AmbiguousJobError: see ``find_job``.
    """
    from dlrover_core.cli.job_files import find_job
    from dlrover_core.cli.jobs_list import running_masters

    masters = (running_masters(args.address) if connect else None) or {}
    running = {n: st.get("job_dir") or "" for n, (_, st) in masters.items()}
    try:
        ref = find_job(args.name, args.job_dir, running=running if connect else None)
    except FileNotFoundError:
        if args.job_dir or args.name not in masters:
            raise
        master, st = masters[args.name]  # running, its directory unknown here
        return None, master, st
    hit = masters.get(ref.name)
    if hit is not None and os.path.abspath(hit[1].get("job_dir") or "") == ref.job_dir:
        return ref, hit[0], hit[1]
    return ref, None, None


def status_line(st: dict) -> str:
    """``nanogpt run 2 (/.../runs/nanogpt): running step 41/100 elapsed 35 s restarts 0
    loss=1.9``; during start-up (pending, placing, starting) ``starting (placing)``
    and no step."""
    head = f"{st['name']} run {st.get('run', '?')}"
    if st.get("job_dir"):
        head += f" ({st['job_dir']})"
    elapsed = f"elapsed {st.get('elapsed_s', 0):.0f} s"
    if st["state"] in ("pending", "placing", "starting"):
        return f"{head}: starting ({st['state']}) {elapsed}"
    step = (f"step {st['step']}" + (f"/{st['total_steps']}" if st.get("total_steps") else "")
            if st.get("step", -1) >= 0 else "no step yet")
    m = ", ".join(f"{k}={v:.4g}" for k, v in st.get("metrics", {}).items())
    restarts = format_restarts(st.get("restarts"))
    line = f"{head}: {st['state']} {step} {elapsed} restarts {restarts}" + (f" {m}" if m else "")
    return line + (f"; {health_text(st['health'])}" if st.get("health") else "")


def health_text(health: dict) -> str:
    """``checkpoint_persist failing (persisting trainer step 40: [Errno 28] No space left
    on device)``: the plugins' failing checks (``status()["health"]``), in one line."""
    parts = []
    for check, details in sorted(health.items()):
        inner = [v for v in details.values() if isinstance(v, dict)] or [details]
        what = "; ".join(": ".join(str(x) for x in (d.get("what"), d.get("error")) if x)
                         for d in inner[:2])
        parts.append(f"{check} failing ({what})" if what else f"{check} failing")
    return ", ".join(parts)


def cmd_status(args: argparse.Namespace) -> int:
    from dlrover_core.master.client import read_summary

    ref, master, st = _find_running(args, connect=args.run is None and _connect(args.address))
    if master is not None:
        import ray

        st = ray.get(master.status.remote(), timeout=30)
    else:
        summary = read_summary(ref.job_dir, args.run)
        if summary is None and args.run is None and _running_here(ref, args.json):
            return 0
        if summary is None:
            err.print(f"job {ref.name!r} in {ref.job_dir}: no running master and no summary "
                      "(unfinished: it runs on a cluster this command did not join, or its "
                      "master died with its cluster)", highlight=False)
            return 2
        st = {"name": ref.name, "state": summary["status"], "summary": summary,
              "job_dir": ref.job_dir}
    if args.json:
        print_json(st)
    else:
        from dlrover_core.cli.progress import print_summary

        if st.get("summary"):
            print_summary(st["summary"])
        else:
            print(status_line(st))
    return 0


def _running_here(ref, as_json: bool) -> bool:
    """Print the status of ``ref`` from its files when the process holding its run lock
    is alive on this machine though its JobMaster is not on the joined cluster (several
    Ray clusters on one machine); ``False`` (nothing printed) otherwise."""
    from dlrover_core.cli.jobs_list import job_row
    from dlrover_core.master.dir_lock import live_holder

    holder = live_holder(ref.job_dir)
    if holder is None:
        return False
    row = job_row(ref.job_dir)
    st = {"name": ref.name, "state": "running", "run": row["run"], "job_dir": ref.job_dir,
          "step": (row["steps"] or 0) - 1, "elapsed_s": row["wall_s"] or 0.0,
          "source": "files", "holder": holder}
    if as_json:
        print_json(st)
    else:
        step = f"step {st['step']}" if st["step"] >= 0 else "no step yet"
        print(f"{ref.name} run {row['run']} ({ref.job_dir}): running {step} elapsed "
              f"{st['elapsed_s']:.0f} s (from its files: its JobMaster is on a Ray cluster "
              "this command did not join; give --address to ask it)")
    return True


def cmd_stop(args: argparse.Namespace) -> int:
    if not _connect(args.address):
        err.print("no Ray cluster to connect to; nothing is running")
        return 2
    import ray

    ref, master, _ = _find_running(args)
    if master is None:
        err.print(f"job {ref.name!r} in {ref.job_dir} is not running", highlight=False)
        return 2
    ray.get(master.stop.remote())
    summary = ray.get(master.wait.remote(120))
    master.shutdown.remote()
    print(f"{ref.name if ref else args.name}: {summary['status'] if summary else 'stopping'}")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """Remove a finished job's directory (its runs, logs and ``ckpt/``) and what plugins
    keep for it on this machine (``dlrover_job_deleted``: the flash saver's buffers).
    A running job (its JobMaster alive on the cluster, or a submit holding the
    directory's lock) is refused with exit code 3."""
    import shutil

    from dlrover_core.master.dir_lock import DirInUseError, DirLock

    ref, master, st = _find_running(args, connect=_connect(args.address))
    if ref is None or master is not None:
        name = ref.name if ref else args.name
        err.print(f"[bold red]error:[/] job {name!r} is running"
                  + (f" (run {st.get('run')}, {st.get('state')})" if st else "")
                  + f"; `dlrover stop {name}` first, then delete it", highlight=False)
        return 3
    try:
        with DirLock(ref.job_dir, "job directory", ref.name):
            shutil.rmtree(ref.job_dir)
    except DirInUseError as exc:
        err.print(f"[bold red]error:[/] job {ref.name!r} is running: {exc}; "
                  f"`dlrover stop {ref.name}` first, then delete it", highlight=False)
        return 3
    for line in _pm().job_deleted(ref.name, ref.job_dir):
        print(line)
    print(f"deleted job {ref.name}: {ref.job_dir}")
    return 0
