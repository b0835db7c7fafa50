"""Master scale benchmark: N simulated ranks report steps at R Hz to a real JobMaster.

    .venv/bin/python benchmarks/master_scale.py                       # N = 100, 1000, 5000 at 1 Hz
    .venv/bin/python benchmarks/master_scale.py --ranks 1000,10000 --measure-s 15
    .venv/bin/python benchmarks/master_scale.py --ranks 1000 --node-size 0   # no agents

What runs: a local Ray cluster owned by this process; a real JobMaster (created with
``create_master``, as ``dlrover submit`` does) running a one-rank job whose worker
idles; ``--senders`` simulator actors, each speaking for N / senders ranks of a role
``sim``. The simulated ranks are entered into the master's instance table (state
``running``, no actor behind them: this is the simulation part) so that every report
finds its instance, as a real rank's would. Each simulated rank steps at R Hz and
calls ``JobMaster.report`` as ``BaseWorkload.report`` does (its ``StepReporter``):
rank 0 every step, every other rank once per ``report_interval_s(N)`` with its newest
step, phases spread evenly over the period. ``--no-coalesce`` sends every step of every
rank (the behaviour before ``StepReporter``).

With ``--node-size K`` (default 8; 0: off) the ranks are on simulated nodes of K ranks,
and every rank but rank 0 reports through its node's agent
(:mod:`dlrover_core.runtime.node_reporter`): each simulated node sends one
``JobMaster.report_batch`` call per ``report_interval_s(N)`` holding the newest step of
each of its ranks, as the agent forwards them; rank 0 still reports every step directly.

Baseline, measured in the same run: the same senders, with the same traffic, drive a
``ReportSink`` actor whose ``report`` does nothing, created with the master's actor
options: Ray's own cost of the calls. ``cpu_ratio`` = master CPU / sink CPU.

Figures, per N, over the measurement window (after ``--warmup-s``):
- ``master_cpu``: CPU seconds of the master process (all its threads, from
  ``/proc/<pid>/stat``) per wall second; 1.0 = one core busy;
- ``lag_p50_s``, ``lag_p99_s``: from the sender's ``report.remote()`` to the reply
  being seen by the sender (s);
- ``sqlite_writes_per_s``: committed JobContext writes (``JobContext.writes``; rows
  changed per s from SQLite's ``total_changes`` on older masters);
- ``reports_per_s``: calls to the master per second (a batch is one call);
  ``entries_per_s``: rank reports carried by them;
- ``master_rss_bytes``: the master's resident memory at the end of the window;
- ``reattach_s`` (with agents only): after the window the master process is SIGKILLed,
  Ray restarts it, and the new master re-attaches
  (:mod:`dlrover_core.master.reattach`): the ``seconds`` of its ``master_reattached``
  event (the job's context read back, the agents asked, the actors probed);
  ``restart_to_reattached_s``: from the kill to that event (Ray's restart of the actor
  included); ``reattached`` / ``reattached_from_agents`` / ``reattach_lost``: the
  instances it attached, those of them from an agent's roster, and those it found
  lost. Simulation part: the simulated ranks' rows are written to the job's context
  (node ``simnode-<k>``), and each sender answers as the agent of its nodes: the
  master learns ``node -> sender`` from the ``report_batch`` calls (as it learns a
  real agent's name), and a sender's ``roster(node)`` lists that node's ranks with
  the sender's own handle and pid (alive), as a real agent lists its ranks. So the
  master's side is real (one look-up and one ``roster`` call per node, the
  attach of every rank, the watch of every rank's handle); the answering side is
  four processes instead of one per node.
- ``master_rss_per_1000_ranks_bytes`` (top level): the master's RSS at the largest N
  less that at the smallest N of the run, per 1,000 ranks between them (bytes).

The machine is shared and small (2 cores here): the senders, the raylet and the master
compete for the same cores, so figures move from run to run; run it three times.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ray  # noqa: E402

from dlrover_core import BaseWorkload  # noqa: E402

SIM_ROLE = "sim"
SLOT_S = 0.01  # the senders send what is due every 10 ms


class Idle(BaseWorkload):
    """The one real rank of the benchmark job: it sleeps until the master stops it."""

    def run(self) -> None:
        while True:
            time.sleep(1.0)


class ReportSink:
    """The baseline: an actor with the master's ``report`` signature that does nothing."""

    @ray.method(concurrency_group="report")
    def report(self, role: str, rank: int, step: int, metrics: dict, ts: float) -> None:
        return None

    @ray.method(concurrency_group="report")
    def report_batch(self, entries: list, agent: str | None = None,
                     node_id: str | None = None) -> None:
        return None

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class RankSimulator:
    """Speaks for ``ranks`` from ``start_at`` (unix s) for ``duration_s``, each rank
    stepping at ``rate_hz`` and sending as ``BaseWorkload.report`` does: rank 0 every
    step; every other rank once per ``interval_s`` (its newest step), phases spread
    evenly. ``interval_s`` = 0 sends every step of every rank (no coalescing).
    ``node_size`` > 0: ``ranks`` are node indices instead; each node (ranks
    ``node * node_size`` ...) sends one ``report_batch`` of its non-zero ranks per
    ``interval_s``, and node 0's rank 0 reports every step."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.nodes: dict[str, list[int]] = {}  # simulated node -> its ranks
        self.newest_step = -1
        self._stopped: asyncio.Event | None = None

    async def roster(self, node_id: str | None = None) -> list[dict]:
        """As :meth:`NodeReporter.roster`: the simulated ranks of ``node_id``, each with
        this actor's handle and pid (the simulation part: module doc)."""
        me = ray.get_runtime_context().current_actor
        info = {"node_id": node_id, "ip": "127.0.0.1", "pid": os.getpid()}
        return [{"role": SIM_ROLE, "rank": r, "actor_name": f"sim-{r}", "handle": me,
                 "info": info, "step": self.newest_step, "metrics": {},
                 "alive": os.path.exists(f"/proc/{os.getpid()}")}
                for r in self.nodes.get(node_id, [])]

    async def wait_run(self) -> None:
        """The master's watch of a re-attached rank: returns when the actor dies."""
        if self._stopped is None:
            self._stopped = asyncio.Event()
        await self._stopped.wait()

    async def run(self, target_name: str, namespace: str, ranks: list[int], n_total: int,
                  rate_hz: float, interval_s: float, start_at: float, duration_s: float,
                  measure_from: float, node_size: int = 0) -> dict:
        target = ray.get_actor(target_name, namespace=namespace)
        if node_size:
            self.nodes = {f"simnode-{k}": list(range(max(1, k * node_size),
                                                     min(n_total, (k + 1) * node_size)))
                          for k in ranks}
        period = 1.0 / rate_hz
        lags: list[float] = []
        tasks: list[asyncio.Task] = []
        sent = entries = 0
        batched: set[int] = set()  # nodes that sent a batch

        async def track(ref: Any, ts: float, measured: bool) -> None:
            await ref
            if measured:
                lags.append(time.time() - ts)

        events = []  # (offset s, rank or -1 - node)
        n_nodes = -(-n_total // node_size) if node_size else 0
        for r in ranks:
            units = [(r, r, n_total)] if not node_size else [(-1 - r, r, n_nodes)] + (
                [(0, 0, n_total)] if r == 0 else [])
            for who, index, count in units:
                every = period if (who == 0 or interval_s <= 0) else interval_s
                t = (index / count) * every
                while t < duration_s:
                    events.append((t, who))
                    t += every
        events.sort()
        i = 0
        while i < len(events):
            due = start_at + events[i][0]
            now = time.time()
            if due > now:
                await asyncio.sleep(due - now)
            slot_end = due + SLOT_S
            while i < len(events) and start_at + events[i][0] < slot_end:
                offset, rank = events[i]
                step = int(offset / period)
                ts = time.time()
                metrics = {"loss": 1.0 / (step + 1)}
                if rank >= 0:
                    ref = target.report.remote(SIM_ROLE, rank, step, metrics, ts)
                    carried = 1
                else:  # a node's agent: the newest step of each of its non-zero ranks
                    first = (-1 - rank) * node_size
                    batch = [(SIM_ROLE, r, step, metrics, ts)
                             for r in range(max(1, first), min(n_total, first + node_size))]
                    ref = target.report_batch.remote(batch, self.name,
                                                     f"simnode-{-1 - rank}")
                    self.newest_step = max(self.newest_step, step)
                    batched.add(-1 - rank)
                    carried = len(batch)
                tasks.append(asyncio.ensure_future(track(ref, ts, ts >= measure_from)))
                sent += ts >= measure_from
                entries += carried if ts >= measure_from else 0
                i += 1
            if len(tasks) > 256:
                tasks = [t for t in tasks if not t.done()]
        await asyncio.gather(*tasks)
        return {"lags": lags, "sent": sent, "entries": entries, "nodes": len(batched)}


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all threads), in s."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _master_pid(scope: Any) -> int:
    return os.getpid()


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (bytes), from ``/proc/<pid>/status``."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _sqlite_writes(master_self: Any) -> int:
    """Committed writes of the master's JobContext (rows changed on older masters)."""
    ctx = _scope(master_self).context
    writes = getattr(ctx, "writes", None)
    if writes is not None:
        return int(writes)
    return int(ctx._db.total_changes)


def _scope(master_self: Any) -> Any:
    controller = getattr(master_self, "controller", None)
    return controller.scope if controller is not None else master_self


def _add_sim_ranks(master_self: Any, n: int, node_size: int = 0) -> int:
    """Enter ``n`` simulated ranks of role ``sim`` into the master's instance table and
    its context (one transaction), as running instances without an actor on nodes
    ``simnode-<rank // node_size>`` (the simulation part of this benchmark)."""
    from dlrover_core.master.instances import Instance, InstanceState

    table = _scope(master_self).instances
    now = time.time()
    rows = []
    for r in range(n):
        inst = Instance(SIM_ROLE, r, None, f"sim-{r}", state=InstanceState.RUNNING,
                        last_report_ts=now)
        if node_size:
            inst.node_id = f"simnode-{r // node_size}"
        table.adopt(inst)
        rows.append(inst.record())
    table.context.put_instances(rows)
    return n


def _forget_sim_handles(master_self: Any) -> int:
    """Before the job stops: the simulated ranks' handles (the senders) are dropped,
    so that stopping the job does not kill the senders once per simulated rank."""
    n = 0
    for inst in list(_scope(master_self).instances.roles.values()):
        if inst.role == SIM_ROLE:
            inst.handle = None
            n += 1
    return n


def _events(job_dir: str, name: str) -> list[dict]:
    from dlrover_core.master.events import read_events

    path = os.path.join(job_dir, "events.jsonl")
    return [e for e in read_events(path) if e["event"] == name] if os.path.exists(path) else []


def restart_and_reattach(master: Any, job_dir: str, pid: int, timeout_s: float = 300) -> dict:
    """SIGKILL the master process ``pid``; Ray restarts it and it re-attaches. Returns
    the figures of its ``master_reattached`` event (module doc)."""
    import signal

    before = len(_events(job_dir, "master_reattached"))
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    deadline = t_kill + timeout_s
    while True:
        found = _events(job_dir, "master_reattached")
        if len(found) > before:
            e = found[-1]
            return {"reattach_s": e["seconds"],
                    "restart_to_reattached_s": round(e["ts"] - t_kill, 3),
                    "reattached": len(e["attached"]), "reattached_from_agents":
                    e.get("from_agents"), "reattach_lost": len(e["lost"])}
        if time.time() > deadline:
            raise RuntimeError(f"the restarted master did not re-attach in {timeout_s} s")
        time.sleep(0.2)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def drive(target_name: str, pid: int, n: int, rate_hz: float, interval_s: float, senders: int,
          warmup_s: float, measure_s: float, sqlite_probe: Any = None,
          node_size: int = 0, after: Any = None) -> dict:
    """Run the senders against ``target_name``; measure the target process ``pid``.
    ``after(nodes)``: called once the senders are done, while they still live, with
    the number of simulated nodes that sent a batch; its dict is added to the figures."""
    from dlrover_core.runtime.context import MASTER_NAMESPACE

    tag = f"{target_name}-{time.time_ns()}"
    sims = [RankSimulator.options(name=f"sim-sender-{tag}-{i}",
                                  namespace=MASTER_NAMESPACE).remote(f"sim-sender-{tag}-{i}")
            for i in range(senders)]
    ray.get([s.__ray_ready__.remote() for s in sims])
    start_at = time.time() + 1.0
    measure_from = start_at + warmup_s
    units = -(-n // node_size) if node_size else n  # nodes or ranks, spread over senders
    refs = [s.run.remote(target_name, MASTER_NAMESPACE, list(range(i, units, senders)), n,
                         rate_hz, interval_s, start_at, warmup_s + measure_s, measure_from,
                         node_size)
            for i, s in enumerate(sims)]
    time.sleep(max(0.0, measure_from - time.time()))
    cpu0, t0 = cpu_seconds(pid), time.time()
    w0 = sqlite_probe() if sqlite_probe else None
    time.sleep(max(0.0, measure_from + measure_s - time.time()))
    cpu1, t1 = cpu_seconds(pid), time.time()
    rss = rss_bytes(pid)
    w1 = sqlite_probe() if sqlite_probe else None
    outs = ray.get(refs, timeout=600)
    extra = after(sum(o["nodes"] for o in outs)) if after is not None else {}
    for s in sims:
        ray.kill(s)
    lags = [x for o in outs for x in o["lags"]]
    out = {"cpu_share": round((cpu1 - cpu0) / (t1 - t0), 4),
           "lag_p50_s": _r(percentile(lags, 0.5)), "lag_p99_s": _r(percentile(lags, 0.99)),
           "reports_per_s": round(sum(o["sent"] for o in outs) / measure_s, 1),
           "entries_per_s": round(sum(o["entries"] for o in outs) / measure_s, 1),
           "rss_bytes": rss}
    if w0 is not None:
        out["sqlite_writes_per_s"] = round((w1 - w0) / (t1 - t0), 2)
    out.update(extra)
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def run_one(n: int, rate_hz: float, coalesce: bool, senders: int, warmup_s: float,
            measure_s: float, work_dir: str, node_size: int = 0) -> dict:
    from dlrover_core import DLJobBuilder
    from dlrover_core.master.client import MASTER_MAX_RESTARTS, create_master
    from dlrover_core.runtime.context import MASTER_NAMESPACE, master_actor_name
    from dlrover_core.runtime.reporting import report_interval_s

    interval_s = report_interval_s(n) if coalesce else 0.0

    # baseline: Ray's own cost of the same calls, on an actor made like the master
    sink_name = f"report-sink-{n}"
    sink = ray.remote(concurrency_groups={"report": 1})(ReportSink).options(
        name=sink_name, namespace=MASTER_NAMESPACE, max_concurrency=64, num_cpus=0,
        max_restarts=MASTER_MAX_RESTARTS).remote()
    base = drive(sink_name, ray.get(sink.pid.remote()), n, rate_hz, interval_s, senders,
                 warmup_s, measure_s, node_size=node_size)
    ray.kill(sink)

    name = f"scale-{n}"
    job = (DLJobBuilder().name(name).workload("trainer", "benchmarks.master_scale", "Idle")
           .total(1).resource(cpu=0.1).config({}).build())
    master = create_master(job.spec, os.path.join(work_dir, name))
    ray.get(master.start.remote())
    deadline = time.time() + 120
    while ray.get(master.status.remote())["state"] != "running":
        if time.time() > deadline:
            raise RuntimeError("the benchmark job did not reach running in 120 s")
        time.sleep(0.2)
    ray.get(master.__ray_call__.remote(_add_sim_ranks, n, node_size))
    pid = ray.get(master.__ray_call__.remote(_master_pid))
    job_dir = os.path.join(work_dir, name)

    def after(want: int) -> dict:
        if not node_size:
            return {}
        # every agent that sent known and persisted (the master flushes every few s)
        deadline = time.time() + 60
        while len(ray.get(master.__ray_call__.remote(
                lambda self: _scope(self).context.get("agents") or {}))) < want:
            if time.time() > deadline:
                raise RuntimeError(f"the master did not persist {want} agents in 60 s")
            time.sleep(0.5)
        return restart_and_reattach(master, job_dir, pid)

    ours = drive(master_actor_name(name), pid, n, rate_hz, interval_s, senders, warmup_s,
                 measure_s,
                 lambda: ray.get(master.__ray_call__.remote(_sqlite_writes)), node_size,
                 after)
    st = ray.get(master.status.remote())
    ray.get(master.__ray_call__.remote(_forget_sim_handles))
    master.stop.remote()
    ray.get(master.wait.remote(60))
    ray.kill(master, no_restart=True)
    return {"ranks": n, "node_size": node_size, "rate_hz": rate_hz,
            "report_interval_s": interval_s,
            "master_cpu": ours["cpu_share"],
            "lag_p50_s": ours["lag_p50_s"], "lag_p99_s": ours["lag_p99_s"],
            "reattach_s": ours.get("reattach_s"),
            "restart_to_reattached_s": ours.get("restart_to_reattached_s"),
            "reattached": ours.get("reattached"),
            "reattached_from_agents": ours.get("reattached_from_agents"),
            "reattach_lost": ours.get("reattach_lost"),
            "sqlite_writes_per_s": ours.get("sqlite_writes_per_s"),
            "reports_per_s": ours["reports_per_s"], "entries_per_s": ours["entries_per_s"],
            "master_rss_bytes": ours["rss_bytes"],
            "baseline_cpu": base["cpu_share"], "baseline_lag_p99_s": base["lag_p99_s"],
            "baseline_reports_per_s": base["reports_per_s"],
            "cpu_ratio": round(ours["cpu_share"] / base["cpu_share"], 2)
            if base["cpu_share"] > 0 else None,
            "master_step": st["step"]}


def _rss_slope(rows: list[dict]) -> int | None:
    """The master's RSS growth per 1,000 ranks between the smallest and the largest
    rank count of the run (bytes), or ``None`` with fewer than two counts."""
    rows = sorted(rows, key=lambda r: r["ranks"])
    if len(rows) < 2 or rows[-1]["ranks"] == rows[0]["ranks"]:
        return None
    return int((rows[-1]["master_rss_bytes"] - rows[0]["master_rss_bytes"])
               / (rows[-1]["ranks"] - rows[0]["ranks"]) * 1000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", nargs="+", default=["100,1000,5000"],
                    help="rank counts, comma or space separated")
    ap.add_argument("--node-size", type=int, default=8,
                    help="ranks per simulated node, each node reporting through one agent "
                         "(0: every rank reports directly)")
    ap.add_argument("--rate-hz", type=float, default=1.0, help="steps per second per rank")
    ap.add_argument("--senders", type=int, default=4, help="simulator actors")
    ap.add_argument("--no-coalesce", action="store_true",
                    help="every rank sends every step (the behaviour before StepReporter)")
    ap.add_argument("--warmup-s", type=float, default=4.0)
    ap.add_argument("--measure-s", type=float, default=12.0)
    ap.add_argument("--cpus", type=int, default=4, help="num_cpus of the local Ray cluster")
    args = ap.parse_args(argv)
    try:
        args.ranks = [int(x) for arg in args.ranks for x in str(arg).split(",") if x]
    except ValueError:
        ap.error(f"--ranks: {args.ranks!r} is invalid; allowed: integers >= 1, e.g. 1000,10000")
    if args.node_size < 0:
        ap.error(f"--node-size: {args.node_size} is invalid; allowed: an integer >= 0")
    for key in ("rate_hz", "warmup_s", "measure_s"):
        if getattr(args, key) <= 0:
            ap.error(f"--{key.replace('_', '-')}: {getattr(args, key)} is invalid; allowed: > 0")
    if args.senders < 1 or any(n < 1 for n in args.ranks):
        ap.error("--senders and --ranks: allowed: integers >= 1")

    from dlrover_core.master.client import init_ray

    os.chdir(ROOT)  # the workers import benchmarks.master_scale from here
    temp_dir = tempfile.mkdtemp(prefix="dlms", dir="/tmp")
    work_dir = tempfile.mkdtemp(prefix="dlms-jobs")
    init_ray(None, num_cpus=args.cpus, _temp_dir=temp_dir)
    try:
        runs = [run_one(n, args.rate_hz, not args.no_coalesce, args.senders, args.warmup_s,
                        args.measure_s, work_dir, args.node_size) for n in args.ranks]
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(work_dir, ignore_errors=True)
    target = next((r for r in runs if r["ranks"] == 1000), None)
    print(json.dumps({
        "benchmark": "master_scale", "rate_hz": args.rate_hz, "senders": args.senders,
        "coalesce": not args.no_coalesce, "node_size": args.node_size,
        "measure_s": args.measure_s, "cpu_count": os.cpu_count(), "rows": runs,
        "target_1000_met": None if target is None else bool(
            target["master_cpu"] < 0.2 and (target["lag_p99_s"] or 0) < 1.0),
        "master_rss_per_1000_ranks_bytes": _rss_slope(runs),
        "median_cpu_ratio": statistics.median([r["cpu_ratio"] for r in runs
                                               if r["cpu_ratio"] is not None] or [0]),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
