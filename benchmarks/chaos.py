"""Chaos run: a seeded random schedule of real faults against the nanoGPT job on a
3-node cluster, checked against invariants at the end.

    .venv/bin/python benchmarks/chaos.py --minutes 30 --seed 1      # make chaos MINUTES=30 SEED=1
    .venv/bin/python benchmarks/chaos.py --minutes 3 --seed 7 --faults kill_rank,kill_master
    .venv/bin/python benchmarks/chaos.py --minutes 30 --seed 1 --elastic  # + resizes

The cluster: ``dlrover cluster up`` (:mod:`dlrover_core.cli.local_cluster`): a head with
no CPUs (the JobMaster) and two worker nodes of 2 CPUs, each its own ``ray start``
process group on this machine. The job: ``examples/nanogpt/job_flash.yaml`` with the
tiny model (1 layer, width 32), 2 ranks under FSDP2 spread over the worker nodes, the
flash saver with ``replicas: 1`` (a save every 5 steps, a commit to disk every 20th),
the checkpoint folder on a tmpfs of its own (so that "disk full" is a real ENOSPC), the
ranks' sample-id logs (``config.record_samples``). The job's ``max_steps`` is sized from
a calibration job (the mean step time over the second half of 800 steps) so that the
fault-free run takes about ``--minutes`` (:data:`FAULT_FREE_SHARE`), and the run with
faults longer.

``--elastic`` (:data:`ELASTIC`): the trainer role is elastic over the two worker nodes
(``nodes: 1:2``, one rank a node) with a global batch of 2 micro-batches kept by
gradient accumulation, and a lost node not replaced within 10 s: a node loss shrinks the
role to 1 rank (it trains both micro-batches of each step), the node's return grows it
back to 2 after the next checkpoint, and the trigger ``resize`` makes a fault while it
grows. Micro-batch ``j`` of step ``s`` is the same samples at any world size
(``examples/nanogpt/workload.py``), gradient clipping is off (a clip coefficient from a
norm summed over 1 or 2 shards differs in its last bit), so a resize is exact: the
losses are still compared bit for bit.

SIGTERM or SIGINT stops a run early (status ``stopped``): its cluster goes down, and
the cut-off job's flash buffers and the checkpoint tmpfs are removed.

First the job runs with no faults (same seed, same steps), then with faults. The job's
seed is ``--job-seed`` (default ``--seed``, which draws the schedule); the fault-free run
of a job seed (its steps, final state digests, every micro-batch's losses) can be saved
with ``--save-reference FILE`` and taken by later runs of the same job seed with
``--reference FILE`` instead of running it again: the job is deterministic, so it is
the same run. The
schedule (``random.Random(seed)``) draws each fault's kind from ``--faults``, its point
in the run (a step: the run with faults is slower than the fault-free one, so a time
drawn from the latter could fall after the end; a step between 5 % and 90 % of
``max_steps`` cannot) and its trigger: ``time`` (once the job's step reached that
point and the job is running), ``commit`` (at the first save of a step due for the
disk after that point: the node's persister is then committing it), ``recovery`` (at
the recovery that the fault before it started: a fault inside a recovery),
``with_previous`` (at once after the fault before it: two faults at the same instant;
after a ``slow_rank``, which the injector carries out for its whole duration, at its
end) or, with ``--elastic`` and after a node loss, ``resize`` (at the ``elastic_room``
event that starts the role's grow back onto the returned node; a node lost several
faults before its resize fault comes back once the fault just before that one is made,
:func:`held_comebacks`, so that the grow comes after it on a slow machine too).
Kinds (:data:`KINDS`):

- ``kill_rank``: SIGKILL of a trainer rank's process;
- ``kill_persister``: SIGKILL of a node's flash persister actor process;
- ``node_loss``: SIGKILL of every process of a worker node hosting a rank (its raylet,
  agents and workers) and of that node's shared-memory slot buffers (its memory; this
  machine shares /dev/shm between the "nodes"); a new node joins 20-40 s later (in a
  thread: the schedule goes on while it joins), or at once when the next fault is a
  node loss too (so that it finds a node to take at its step, not after the job's end);
- ``kill_master``: SIGKILL of the JobMaster actor's process (Ray restarts the actor);
- ``hang_rank``: SIGSTOP of a rank for ``hang_timeout_s + 15`` s, then SIGCONT;
- ``disk_full``: the checkpoint tmpfs filled to the last byte for 20-40 s;
- ``slow_rank``: a rank slowed from outside for 20-40 s (SIGSTOP 0.3 s / SIGCONT 0.3 s).

Invariants (each failure is one string in ``violations``): the job succeeded; the
final model state (the committed step ``max_steps`` on disk, every tensor) equals the
fault-free run's bit for bit (when both ended at the same world size; else through the
losses: ``final_state_compared``), and every micro-batch's loss at every step too; the
ranks' sample-id logs replayed in time order (a resume at step ``c`` rolls back every
micro-batch's records of steps ``>= c``) train each micro-batch of every step
``0..max_steps-1`` exactly once, on the ids the data gives for it (no sample lost,
none trained twice), and the committed steps agree with it; every fault
injected is followed by its recovery in ``events.jsonl`` (a ``recovery_started`` /
``master_restarted`` and then a step, or for faults that need no restart, steps after
the fault ended); ``summary.json`` agrees with the events (restarts per level, steps,
goodput); after ``cluster down`` no process of the cluster is left, no
``/dev/shm/dlrflash-<job>`` buffer and no run lock.

The last line of output is one JSON object: ``status``, ``faults_injected``,
``faults_recovered``, ``violations``, ``goodput``, ``steps_redone``, ``recovery_s``
(``{"median", "max"}``, s from a fault to the first step after its recovery),
``seed``, ``elastic``, ``world_sizes`` (the role's world sizes in order, from the logs)
and the run's details (``faults``: each fault's kind, trigger, target, time and, for a
fault that restarts something, its ``recovery_s``;
``skipped``: the faults not made, and why: the job had ended before their step, or a
fault that restarts something came after every rank had finished its last step, see
:func:`after_last_step`).
Exit status 0 when ``violations`` is empty. A run with a violation keeps its files
(``work``, in the JSON line; :func:`keep_evidence`), so that it can be explained.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

KINDS = ("kill_rank", "kill_persister", "node_loss", "kill_master", "hang_rank",
         "disk_full", "slow_rank")
#: Faults that make the master restart something (a recovery event follows them).
RESTARTING = {"kill_rank", "node_loss", "hang_rank"}
#: Events that report a fault that restarts nothing (none wanted for a slowed rank: it
#: may stay under the straggler detector's threshold).
FAULT_EVENTS = {"kill_persister": ("health_failing", "flash_persister_restarted"),
                "disk_full": ("health_failing",), "slow_rank": ()}
TINY = ["config.n_layer=1", "config.n_embd=32", "config.n_head=2", "config.block_size=32",
        "config.batch_size=8", "config.eval_batches=1", "config.lr=1e-2",
        "config.warmup_steps=2"]
SAVE_EVERY, PERSIST_EVERY = 5, 20
HANG_TIMEOUT_S = 30.0
#: ``--elastic``: the trainer role over 1 to 2 worker nodes (one rank each), the global
#: batch of 2 micro-batches kept by accumulation at any world size, a lost node replaced
#: within 10 s or the role shrinks (a lost node comes back 20-40 s later: then it grows)
ELASTIC = ["roles.trainer.nodes={min: 1, max: 2}", "roles.trainer.per_node=1",
           # a rank takes most of a worker node (2 CPUs): the other node cannot hold
           # the lost node's rank, so the role shrinks (with 0.5 both fit on one node);
           # 1.5, not 2: Ray sets OMP_NUM_THREADS to the floor of the CPUs (2 threads a
           # rank on this 2-core machine made a step 4 times slower)
           "roles.trainer.resources.cpu=1.5",
           # a placement group per node-slot (pack, the default), not one for the role
           # (spread): a resize keeps the survivors' groups and places the rest beside
           "placement=pack",
           "elastic.global_batch=16", "elastic.micro_batch=8",
           "elastic.replacement_timeout_s=10", "elastic.poll_interval_s=2",
           # no clipping: a clip coefficient from a gradient norm summed over 1 or 2
           # shards differs in its last bit; without it a resize is exact (the 1/2 of
           # the accumulation is a power of 2)
           "+config.grad_clip=0"]
CKPT_FS_MIB = 32
JOB_TIMEOUT_S = 3600.0


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, start time in ticks)`` of ``pid``; ``None``: gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (fields[0], int(fields[1]), int(fields[19]))


def _cmdline(pid: int) -> str | None:
    """The command line of ``pid`` (``None``: gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return None


def read_jsonl(path: str) -> list[dict]:
    """The JSON lines of ``path`` ([] when absent); a cut last line (its writer was
    killed) is skipped."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


# ------------------------------------------------------------------ cluster and job
class Chaos:
    """One cluster, its jobs and the faults made in them."""

    def __init__(self, work: str, seed: int, elastic: bool = False) -> None:
        from dlrover_core.cli import local_cluster as lc

        self.elastic = elastic

        self.lc, self.work, self.seed = lc, work, seed
        self.cluster_dir = os.path.join(work, "cluster")
        log("cluster up: a head (0 CPUs) and 2 worker nodes of 2 CPUs")
        self.state = lc.up(nodes=2, cpus_per_node=2, head_cpus=0, directory=self.cluster_dir)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
        self.env.update(lc.client_env(self.state))
        os.environ.update(lc.client_env(self.state))
        from dlrover_core.master.client import init_ray

        init_ray(self.state["address"])
        self.mounts: list[str] = []
        self.seen: dict[int, int] = {}  # pid -> start time of the cluster's processes
        self.clients: list[subprocess.Popen] = []  # the `dlrover submit` processes

    # -------------------------------------------------------------- checkpoint tmpfs
    def ckpt_fs(self, name: str) -> tuple[str, bool]:
        """A checkpoint folder on a tmpfs of its own (``CKPT_FS_MIB``); ``(path,
        mounted)``: a plain folder when ``mount`` is refused (no ``disk_full`` then)."""
        path = os.path.join(self.work, name)
        os.makedirs(path, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={CKPT_FS_MIB}M", "tmpfs", path],
                           capture_output=True, text=True)
        if r.returncode == 0:
            self.mounts.append(path)
            return path, True
        log(f"mount refused ({r.stderr.strip()}): {path} is a plain folder, no disk_full")
        return path, False

    def unmount_all(self) -> None:
        for p in self.mounts:
            subprocess.run(["umount", "-l", p], capture_output=True)
        self.mounts = []

    # -------------------------------------------------------------------- job
    def overrides(self, name: str, steps: int, ckpt: str, samples: str) -> list[str]:
        return TINY + [
            f"name={name}", f"config.seed={self.seed}", f"config.max_steps={steps}",
            f"config.eval_every={steps}", f"+config.record_samples={samples}",
            "placement=spread", "roles.trainer.resources.cpu=0.5",
            f"checkpoint.dir={ckpt}", f"checkpoint.every_steps={SAVE_EVERY}", "checkpoint.keep=2",
            f"checkpoint.options.persist_every_steps={PERSIST_EVERY}",
            "checkpoint.options.replicas=1",
            "failover.max_restarts=1000", "failover.max_node_failures=1000",
            # a 30-minute schedule draws several master kills (seed 1: 7 of 30); the
            # default of 3 Ray restarts ended the job's control at the 4th
            "failover.master_max_restarts=1000",
            f"failover.hang_timeout_s={HANG_TIMEOUT_S:g}", "failover.pg_timeout_s=60",
            "failover.survivor_grace_s=5", "node_health.skip_node_check=true",
            *(ELASTIC if self.elastic else [])]

    def submit(self, name: str, job_dir: str, over: list[str]) -> subprocess.Popen:
        os.makedirs(job_dir, exist_ok=True)
        out = open(os.path.join(job_dir, "submit.log"), "ab")
        cmd = [sys.executable, "-m", "dlrover_core.cli.main", "submit",
               "examples/nanogpt/job_flash.yaml", *over, "--job-dir", job_dir, "--no-progress",
               "--address", self.state["address"]]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out,
                                stderr=subprocess.STDOUT)
        self.clients.append(proc)
        return proc

    def master_status(self, name: str) -> dict | None:
        import ray

        from dlrover_core.master.client import get_master

        try:
            return ray.get(get_master(name).status.remote(), timeout=20)
        except Exception:  # noqa: BLE001 - not up yet, restarting, or gone
            return None

    # ------------------------------------------------------------------ processes
    def worker_nodes(self) -> list[dict]:
        from dlrover_core.pids import pid_alive

        return [n for n in self.state["nodes"] if not n["head"] and pid_alive(n["pid"])]

    def node_of(self, node_id: str) -> dict | None:
        return next((n for n in self.state["nodes"] if n["node_id"] == node_id), None)

    def cluster_pids(self) -> dict[int, str]:
        """Every live process of this cluster: the nodes' process groups and their
        descendants (Ray starts its workers in sessions of their own, children of the
        node's raylet). pid -> the start of its command line. Each one found is
        remembered (with its start time) for :meth:`leftovers`."""
        procs = {}
        for e in os.listdir("/proc"):
            if e.isdigit():
                st = _stat(int(e))
                if st is not None:
                    procs[int(e)] = st
        ours = {p for n in self.state["nodes"] for p in self.lc.group_pids(n["pgid"])}
        grew = True
        while grew:
            kids = {p for p, st in procs.items() if st[1] in ours} - ours
            grew = bool(kids)
            ours |= kids
        out = {}
        for p in ours:
            # a process of a node's group may have started after the /proc scan above
            # (a node joining in the injector's thread): read it now
            st, c = procs.get(p) or _stat(p), _cmdline(p)
            if c is not None and st is not None:
                out[p] = c
                self.seen[p] = st[2]
        return out

    def master_pid(self) -> int | None:
        return next((p for p, c in self.cluster_pids().items()
                     if c.startswith("ray::JobMaster")), None)

    def persister_pid(self, job: str, node_id: str) -> int | None:
        import ray

        from dlrover_plugin_flashckpt.handles import persister_name
        from dlrover_plugin_flashckpt.persister import NAMESPACE

        try:
            a = ray.get_actor(persister_name(job, node_id), namespace=NAMESPACE)
            return int(ray.get(a.status.remote(), timeout=20)["pid"])
        except Exception:  # noqa: BLE001 - none on that node (yet)
            return None

    def leftovers(self) -> list[str]:
        """Processes of the cluster still alive: found now (:meth:`cluster_pids`) or
        seen while it ran and still the same process (same start time)."""
        left = dict(self.cluster_pids())
        for p, start in self.seen.items():
            st = _stat(p)
            if st is not None and st[2] == start and p not in left:
                left[p] = _cmdline(p) or "?"
        return [f"pid {p}: {c}" for p, c in sorted(left.items())]

    def down(self) -> None:
        import ray

        ray.shutdown()
        try:
            self.lc.down(self.cluster_dir)
        except Exception as e:  # noqa: BLE001 - reported by the leak check
            log(f"cluster down: {e}")
        # a run stopped mid-job leaves its submit client waiting for the cluster (Ray's
        # driver retries the head for a minute), holding the job's run lock
        for proc in self.clients:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def run_to_end(ch: Chaos, name: str, job_dir: str, over: list[str],
               on_running=None, timeout_s: float = JOB_TIMEOUT_S) -> dict:
    """Submit the job, call ``on_running(t0)`` (the fault loop) once it reports a step,
    then wait for its end. Returns ``{"rc", "summary", "t0", "t_end"}``."""
    from dlrover_core.master.client import read_summary

    proc = ch.submit(name, job_dir, over)
    t0 = time.time()
    metrics = os.path.join(job_dir, "metrics.jsonl")
    while proc.poll() is None and not read_jsonl(metrics) and time.time() - t0 < 600:
        time.sleep(0.5)
    if on_running is not None and proc.poll() is None:
        on_running(proc)
    end = t0 + max(60.0, timeout_s)
    while proc.poll() is None and time.time() < end:
        ch.cluster_pids()  # remembered for the leak check after cluster down
        time.sleep(5.0)
    try:
        rc = proc.wait(timeout=1)
    except subprocess.TimeoutExpired:
        log(f"{name}: no end within {timeout_s:.0f} s; stopping it")
        subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "stop", name,
                        "--address", ch.state["address"]], cwd=ROOT, env=ch.env,
                       capture_output=True, timeout=300)
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    try:
        summary = read_summary(job_dir)
    except Exception:  # noqa: BLE001 - no summary is a violation below
        summary = None
    return {"rc": rc, "summary": summary, "t0": t0, "t_end": time.time()}


# ------------------------------------------------------------------ the schedule
def make_schedule(seed: int, kinds: list[str], window_s: float, n: int,
                  steps: int | None = None, elastic: bool = False) -> list[dict]:
    """``n`` faults of ``kinds`` at seeded random points ``x`` in ``[0.05, 0.9]`` of the
    run: ``at_s`` = ``x * window_s`` (s from the job's first step in the fault-free run)
    and ``at_step`` = ``x * steps`` (the step the job must have reached: the run with
    faults is slower, so a time would fall after its end; a step cannot). Each fault
    has its trigger (``time``: at that step; ``commit``; ``recovery``, only after a
    fault that restarts something; ``with_previous``, about one in six: at the same
    instant as the fault before it, two faults at once; with ``elastic``, ``resize``,
    only after a node loss, half of the faults right after one: while the role grows
    back onto the returned node), its
    duration (s; hang,
    disk_full, slow_rank), the delay before a lost node comes back (s) and ``pick``
    (0..1: which candidate target it takes).

    Raises:
        ValueError: ``n`` < 1 or ``steps`` < 1.
    """
    if n < 1 or (steps is not None and steps < 1):
        raise ValueError(f"n={n!r}, steps={steps!r}: allowed n >= 1 and steps >= 1")
    rng = random.Random(seed)
    points = sorted(rng.uniform(0.05, 0.9) for _ in range(n))
    out: list[dict] = []
    for i, x in enumerate(points):
        kind = rng.choice(kinds)
        if elastic:
            # right after a node loss, every other fault lands during the grow back
            after_loss = bool(out) and out[-1]["kind"] == "node_loss"
            trigger = rng.choices(("time", "commit", "recovery", "with_previous", "resize"),
                                  (0.2, 0.1, 0.1, 0.1, 0.5) if after_loss
                                  else (0.32, 0.18, 0.18, 0.14, 0.18))[0]
            if trigger == "resize" and not any(g["kind"] == "node_loss" for g in out[-2:]):
                trigger = "time"
        else:
            trigger = rng.choices(("time", "commit", "recovery", "with_previous"),
                                  (0.4, 0.22, 0.22, 0.16))[0]
        if trigger == "recovery" and not (out and out[-1]["kind"] in RESTARTING | {"kill_master"}):
            trigger = "time"
        if trigger == "with_previous" and not out:
            trigger = "time"
        if trigger == "with_previous":
            x = points[i] = points[i - 1]
        dur = {"hang_rank": HANG_TIMEOUT_S + 15, "disk_full": rng.uniform(20, 40),
               "slow_rank": rng.uniform(20, 40)}.get(kind, 0.0)
        out.append({"i": i, "kind": kind, "trigger": trigger, "at_s": round(x * window_s, 1),
                    "at_step": None if steps is None else int(x * steps),
                    "duration_s": round(dur, 1), "back_after_s": round(rng.uniform(20, 40), 1),
                    "pick": rng.random()})
    return out


def held_comebacks(schedule: list[dict]) -> dict[int, int]:
    """``{i: k}``: the node lost by fault ``i`` comes back once fault ``k`` is made, for
    each ``resize`` fault ``k + 1`` with other faults between it and the node loss ``i``
    before it (see :meth:`Injector.run`)."""
    hold = {}
    for g in schedule:
        if g["trigger"] == "resize":
            loss = max((h["i"] for h in schedule[:g["i"]] if h["kind"] == "node_loss"),
                       default=None)
            if loss is not None and loss < g["i"] - 1:
                hold[loss] = g["i"] - 1
    return hold


class Injector:
    """Carries out a schedule against one running job (see the module doc)."""

    def __init__(self, ch: Chaos, name: str, job_dir: str, ckpt: str, proc: subprocess.Popen,
                 disk_full_ok: bool) -> None:
        self.ch, self.name, self.job_dir, self.ckpt, self.proc = ch, name, job_dir, ckpt, proc
        self.disk_full_ok = disk_full_ok
        self.events_path = os.path.join(job_dir, "events.jsonl")
        self.t0 = time.time()
        self.done: list[dict] = []       # injected faults
        self.skipped: list[dict] = []    # scheduled, not injected (and why)
        self.comebacks: list[float] = []  # when a lost node's replacement is due (unix s)
        self.joining: list[threading.Thread] = []  # replacements starting and joining now
        self.pids_seen: set[int] = set()
        self.timers: list[threading.Timer] = []
        self.commits: list[tuple[float, int]] = []  # (unix s, newest committed step) seen
        self.hold: dict[int, int] = {}  # node loss -> the fault after which it comes back

    def alive(self) -> bool:
        return self.proc.poll() is None

    def sleep(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end and self.alive():
            self.service()
            time.sleep(min(0.2, max(0.0, end - time.time())))

    def service(self) -> None:
        """Start the nodes that are due to come back, each joining in a thread of its own
        (the schedule's steps go on meanwhile: a fault due while a node joins is not
        late); note the cluster's processes."""
        now = time.time()
        self.note_commits()
        if now - getattr(self, "_noted", 0.0) > 5.0:
            self._noted = now
            self.ch.cluster_pids()
        for due in [d for d in self.comebacks if d <= now]:
            self.comebacks.remove(due)
            t = threading.Thread(target=self._come_back, name="chaos-node-back", daemon=True)
            t.start()
            self.joining.append(t)
        self.joining = [t for t in self.joining if t.is_alive()]

    def _come_back(self) -> None:
        node = self.ch.lc.add_node(self.ch.state, num_cpus=2, wait=False)
        log(f"node back: {node['name']} joins")
        try:
            self.ch.lc.wait_for_nodes(self.ch.state, 180)
            log(f"node back: {node['name']} joined")
        except Exception as e:  # noqa: BLE001 - the job goes on with one node
            log(f"node {node['name']} did not join: {e}")

    def nodes_back(self, wait: bool = True) -> None:
        """Bring back at once every lost node not back yet; with ``wait``, wait until
        they joined."""
        self.comebacks = [0.0] * len(self.comebacks)
        self.service()
        if wait:
            for t in self.joining:
                t.join()
            self.joining = []

    def events(self) -> list[dict]:
        """``events.jsonl`` so far, read on from where the last call stopped (without
        the ``checkpoint_saved`` lines of steps not due for the disk: thousands in a
        long run)."""
        if not hasattr(self, "_events"):
            self._events, self._offset = [], 0
        try:
            with open(self.events_path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return self._events
        end = chunk.rfind(b"\n") + 1  # a line being written stays for the next call
        self._offset += end
        for line in chunk[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") != "checkpoint_saved" or e.get("step", 0) % PERSIST_EVERY == 0:
                self._events.append(e)
        return self._events

    def status(self) -> dict | None:
        st = self.ch.master_status(self.name)
        if st:
            self.pids_seen |= {i["pid"] for i in st["instances"].values() if i.get("pid")}
            self.last_status = st
        return st

    def wait_event(self, pred, since: float, timeout_s: float) -> dict | None:
        end = time.time() + timeout_s
        while time.time() < end and self.alive():
            hit = next((e for e in self.events() if e["ts"] >= since and pred(e)), None)
            if hit:
                return hit
            self.sleep(0.1)
        return None

    def in_recovery(self, since: float, timeout_s: float) -> bool:
        """Wait until a recovery is under way (a ``recovery_started`` after ``since``
        with no ``recovery_finished`` after it, or a ``master_restarted`` less than 2 s
        old); ``False`` when the recoveries since ``since`` are over, or after
        ``timeout_s`` with none."""
        end = time.time() + timeout_s
        while time.time() < end and self.alive():
            evs = [e for e in self.events() if e["ts"] >= since]
            started = [e for e in evs if e["event"] == "recovery_started"]
            if started and not any(e["event"] == "recovery_finished"
                                   and e["ts"] >= started[-1]["ts"] for e in evs):
                return True
            if any(e["event"] == "master_restarted" and time.time() - e["ts"] < 2 for e in evs):
                return True
            if started:  # it is over already (the fault before took that long)
                return False
            self.sleep(0.05)
        return False

    def ended(self) -> bool:
        """Whether the job reached a final state (a ``job_state_changed`` to succeeded,
        failed or stopped in the events)."""
        return any(e["event"] == "job_state_changed"
                   and e.get("state") in ("succeeded", "failed", "stopped") for e in self.events())

    def wait_running(self, timeout_s: float = 300) -> dict | None:
        end = time.time() + timeout_s
        while time.time() < end and self.alive():
            st = self.status()
            if st and st["state"] == "running" and st["instances"] and all(
                    i["state"] == "running" and i.get("pid") for i in st["instances"].values()):
                return st
            self.sleep(0.5)
        return None

    def step(self) -> int:
        """The job's step now (the newest step of a rank in the master's status; -1
        while the master does not answer)."""
        st = self.status()
        steps = [i.get("step", -1) for i in (st or {}).get("instances", {}).values()]
        return max([s for s in steps if isinstance(s, int)] or [-1])

    def reached(self, f: dict) -> bool:
        """Whether the job reached fault ``f``'s point: its step ``at_step``, or for a
        schedule without steps its second ``at_s`` since the injector started."""
        if f.get("at_step") is None:
            return time.time() - self.t0 >= f["at_s"]
        return self.step() >= f["at_step"]

    def run(self, schedule: list[dict]) -> None:
        # a node loss whose resize fault comes after other faults: the node comes back
        # once the fault just before the resize one is made, so that the role grows
        # after it, whatever the machine's speed (CI's node was back and the role grown
        # before it, and the resize fault found no grow to fall into)
        self.hold = held_comebacks(schedule)
        release = set(self.hold.values())
        for f in schedule:
            if f["kind"] == "node_loss" and f["trigger"] != "with_previous" and self.comebacks:
                # the node lost last comes back now, not at its drawn time: it joins while
                # the job steps on to this fault's step, which then finds it back (were it
                # brought back only once the step is reached, the fault would come late:
                # after the job's end when the step is near it)
                log(f"fault {f['i']} is a node loss: the node lost before comes back now")
                self.nodes_back(wait=False)
            if f["trigger"] != "with_previous":
                while self.alive() and not self.reached(f):
                    self.sleep(0.5)
            if not self.alive():
                self.skipped += [dict(g, why="the job had ended") for g in schedule[f["i"]:]]
                break
            if f["trigger"] == "with_previous":
                pass  # at once after the fault before it: no wait for anything
            elif f["trigger"] == "recovery" and self.done:
                if not self.in_recovery(self.done[-1]["ts"], 120):
                    f = dict(f, trigger="time (no recovery under way)")
            elif f["trigger"] == "resize" and self.done:
                # the role grows back onto the node that returned: its elastic_room
                # event, then the resize right after the next checkpoint (the node is
                # held back until the fault before this one: :func:`held_comebacks`)
                ev = self.wait_event(lambda e: e["event"] == "elastic_room",
                                     self.done[-1]["ts"], 180)
                if ev is None:
                    f = dict(f, trigger="time (no resize seen)")
                else:
                    f = dict(f, resize_ts=ev["ts"], resize_target=ev.get("target"))
            elif f["trigger"] == "commit":
                since = time.time()
                ev = self.wait_event(lambda e: e["event"] == "checkpoint_saved"
                                     and e["step"] % PERSIST_EVERY == 0, since, 120)
                if ev is None:
                    f = dict(f, trigger="time (no commit seen)")
            else:
                self.wait_running()
            if not self.alive() or self.ended():  # the trigger's wait outlasted the job
                self.skipped += [dict(g, why="the job had ended") for g in schedule[f["i"]:]]
                break
            try:
                rec = self.inject(f)
            except Exception as e:  # noqa: BLE001 - a fault that could not be made
                rec = None
                self.skipped.append(dict(f, why=f"{type(e).__name__}: {e}"))
            if rec is not None:
                self.done.append(rec)
            if f["i"] in release and math.inf in self.comebacks:
                log(f"fault {f['i']} made: the node lost before comes back now")
                self.comebacks = [time.time() if d == math.inf else d
                                  for d in self.comebacks]
        while (self.comebacks or self.joining or any(t.is_alive() for t in self.timers)) \
                and self.alive():
            self.sleep(1.0)
        for t in self.timers:  # the job ended first: end the faults (SIGCONT, space back)
            if t.is_alive():
                t.cancel()
                t.function()
        if self.comebacks or self.joining:  # ... and bring the node back (the cluster goes
            self.nodes_back()                # down clean)
        while self.alive():  # the commits up to the job's end
            self.sleep(1.0)
        self.note_commits()
        for f in self.done:  # the recovery of a persister kill or full disk: a commit
            if f["kind"] in ("kill_persister", "disk_full"):
                after = [(t, s) for t, s in self.commits if t > f["end_ts"]]
                if after:
                    f["commit_after"] = {"step": after[0][1], "ts": after[0][0]}

    # ---------------------------------------------------------------- the faults
    def _pick(self, items: list, pick: float):
        items = sorted(items, key=str)
        return items[min(int(pick * len(items)), len(items) - 1)] if items else None

    def _rank(self, f: dict) -> tuple[str, dict] | None:
        """A live rank process to hit: from the master's status, or from the last one
        it gave while it does not answer (a fault at once after a JobMaster kill); a
        process a fault at the same instant just killed is not a candidate."""
        st = self.status() or getattr(self, "last_status", None)
        cands = [(k, i) for k, i in (st or {}).get("instances", {}).items()
                 if i.get("pid") and _stat(i["pid"]) is not None]
        return self._pick(cands, f["pick"])

    def inject(self, f: dict) -> dict | None:
        kind = f["kind"]
        rec = dict(f, ts=time.time(), t_rel=round(time.time() - self.t0, 1))
        if kind in ("kill_rank", "hang_rank", "slow_rank"):
            r = self._rank(f)
            if r is None:
                self.skipped.append(dict(f, why="no rank process"))
                return None
            label, inst = r
            pid = inst["pid"]
            rec.update(target=label, pid=pid, node_id=inst.get("node_id"))
            if kind == "kill_rank":
                os.kill(pid, signal.SIGKILL)
            elif kind == "hang_rank":
                os.kill(pid, signal.SIGSTOP)  # SIGCONT later, by a timer: the next fault
                log(f"fault {f['i']}: SIGSTOP {label} (pid {pid}) for {f['duration_s']} s")
                self.later(f["duration_s"], lambda: _signal(pid, signal.SIGCONT))
                rec["end_ts"] = time.time() + f["duration_s"]
            else:
                log(f"fault {f['i']}: slowing {label} (pid {pid}) for {f['duration_s']} s")
                end = time.time() + f["duration_s"]
                while time.time() < end and self.alive():
                    if not _signal(pid, signal.SIGSTOP):
                        break
                    time.sleep(0.3)
                    _signal(pid, signal.SIGCONT)
                    time.sleep(0.3)
                _signal(pid, signal.SIGCONT)
        elif kind == "kill_persister":
            r = self._rank(f)
            pid = self.ch.persister_pid(self.name, r[1]["node_id"]) if r else None
            if pid is None:
                self.skipped.append(dict(f, why="no persister found"))
                return None
            rec.update(target=f"persister of {r[0]}'s node", pid=pid, node_id=r[1]["node_id"])
            os.kill(pid, signal.SIGKILL)
        elif kind == "kill_master":
            pid = self.ch.master_pid()
            if pid is None:
                self.skipped.append(dict(f, why="no JobMaster process found"))
                return None
            rec.update(target="JobMaster", pid=pid)
            os.kill(pid, signal.SIGKILL)
        elif kind == "node_loss":
            if len(self.ch.worker_nodes()) < 2 or self.joining:  # the last lost one is
                self.nodes_back()                                   # not back yet
                self.wait_running()
            r = self._rank(f)
            node = self.ch.node_of(r[1]["node_id"]) if r else None
            if node is None or node["head"] or len(self.ch.worker_nodes()) < 2:
                self.skipped.append(dict(f, why="no second worker node"))
                return None
            st = self.status() or {"instances": {}}
            ranks = [int(k.rsplit("-", 1)[1]) for k, i in st["instances"].items()
                     if i.get("node_id") == node["node_id"]]
            rec.update(target=node["name"], node_id=node["node_id"], ranks=ranks)
            rec["pids"] = self.ch.lc.kill_node(self.ch.state, node["name"])
            rec["buffers_removed"] = lose_memory(self.name, node["node_id"], ranks)
            self.comebacks.append(math.inf if f["i"] in self.hold
                                  else time.time() + f["back_after_s"])
        elif kind == "disk_full":
            if not self.disk_full_ok:
                self.skipped.append(dict(f, why="no tmpfs checkpoint folder (mount refused)"))
                return None
            rec.update(target=self.ckpt)
            filler = os.path.join(self.ckpt, ".chaos-fill")
            rec["filled_bytes"] = fill(filler)
            log(f"fault {f['i']}: {self.ckpt} full for {f['duration_s']} s")
            self.later(f["duration_s"], lambda: _unlink(filler))
            rec["end_ts"] = time.time() + f["duration_s"]
        else:
            raise ValueError(f"--faults: unknown kind {kind!r}; allowed: {', '.join(KINDS)}")
        rec.setdefault("end_ts", time.time())
        log(f"fault {f['i']}: {kind} of {rec.get('target')} at {rec['t_rel']} s "
            f"(trigger {f['trigger']})")
        return rec

    def later(self, delay_s: float, action) -> None:
        """Run ``action()`` in ``delay_s`` s (a fault's end), in a timer thread; the
        schedule goes on meanwhile. :meth:`run` waits for every one before it returns."""
        t = threading.Timer(delay_s, action)
        t.start()
        self.timers.append(t)

    def note_commits(self) -> None:
        step = latest_commit(self.ckpt)
        if not self.commits or step != self.commits[-1][1]:
            self.commits.append((time.time(), step))


def latest_commit(ckpt: str) -> int:
    """The trainer's newest committed step in ``ckpt`` (-1: none)."""
    from dlrover_core.checkpoint.saver import committed_steps

    try:
        return max(committed_steps(os.path.join(ckpt, "trainer")), default=-1)
    except OSError:
        return -1


def _unlink(path: str) -> bool:
    """Remove ``path``; False when it was gone already."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def lose_memory(job: str, node_id: str, ranks: list[int]) -> list[str]:
    """What a node's loss takes with it that this machine keeps: the flash slot buffers
    of ``ranks`` (they ran there) and the replica buffers held for peers on
    ``node_id``, from /dev/shm. Returns the names removed."""
    from dlrover_plugin_flashckpt import shm

    slot = re.compile(r"-r(\d{5})-s\d+$")

    def lost(path: str) -> bool:
        m = slot.search(path)
        return bool(m and int(m.group(1)) in ranks) or path.endswith(f"-n{node_id[:12]}")

    return [os.path.basename(p) for p in shm.list_segments("/dev/shm", shm.job_prefix(job))
            if lost(p) and _unlink(p)]


def fill(path: str) -> int:
    """Write ``path`` until its file system is full (ENOSPC); returns the bytes written."""
    n = 0
    block = b"\0" * (1 << 16)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(block)
            except OSError:
                break
        for size in (4096, 1):  # the last partial pages
            while True:
                try:
                    n += f.write(b"\0" * size)
                except OSError:
                    break
    return n


# ------------------------------------------------------------------ invariants
def replay_samples(samples_dir: str, mbs: int, steps: int, seed: int, bs: int,
                   block: int) -> tuple[list[str], dict]:
    """Replay the ranks' sample-id logs, every line of every rank in time order (``t``):
    a resume at step ``c`` (any rank's: the ranks all restore the same step) rolls
    back every micro-batch's records of steps ``>= c``; a record of micro-batch ``j``
    (``mb``; a record without one is its rank's) must be of the step after the last
    one kept for ``j``. The kept history must train micro-batches ``0..mbs-1`` of steps
    ``0..steps-1`` once each, on the ids the data gives for ``(seed, j, step)``, at any
    world size. Returns ``(violations, {"records", "rolled_back", "world_sizes",
    "losses": {mb: [loss per step]}})``."""
    from examples.nanogpt.data import CharDataset

    data = CharDataset()
    bad: list[str] = []
    out: dict = {"records": 0, "rolled_back": 0, "world_sizes": [], "losses": {}}
    recs = []
    for name in sorted(os.listdir(samples_dir)) if os.path.isdir(samples_dir) else []:
        if name.startswith("rank") and name.endswith(".jsonl"):
            r = int(name[4:-6])
            recs += [dict(x, mb=x.get("mb", r)) for x in read_jsonl(os.path.join(samples_dir,
                                                                                name))]
    out["records"] = len(recs)
    recs.sort(key=lambda x: x.get("t", 0.0))
    kept: dict[int, list[dict]] = {j: [] for j in range(mbs)}
    for rec in recs:
        ws = rec.get("world_size")
        if ws is not None and (not out["world_sizes"] or out["world_sizes"][-1] != ws):
            out["world_sizes"].append(ws)
        if "resumed_from" in rec:
            c = int(rec["resumed_from"])
            short = [j for j in kept if len(kept[j]) < c]
            if short:
                bad.append(f"rank {rec['rank']} resumed at step {c} (attempt {rec['attempt']}) "
                           f"but micro-batch(es) {short} hold steps below "
                           f"{min(len(kept[j]) for j in short)} only: samples lost")
            for j in kept:
                out["rolled_back"] += max(0, len(kept[j]) - c)
                kept[j] = kept[j][:c]
            continue
        j = int(rec["mb"])
        if j not in kept:
            bad.append(f"rank {rec['rank']}: micro-batch {j} of step {rec['step']}: only "
                       f"{mbs} a step")
            continue
        if rec["step"] != len(kept[j]):
            bad.append(f"micro-batch {j}: step {rec['step']} trained (rank {rec['rank']}, "
                       f"attempt {rec['attempt']}, pid {rec['pid']}) after step "
                       f"{len(kept[j]) - 1} without a resume between: "
                       + ("trained twice" if rec["step"] < len(kept[j]) else "steps skipped"))
            if rec["step"] < len(kept[j]):
                kept[j] = kept[j][:rec["step"]]
        kept[j].append(rec)
    for j in range(mbs):
        if len(kept[j]) != steps:
            bad.append(f"micro-batch {j}: {len(kept[j])} steps in the kept history; "
                       f"{steps} wanted")
        wrong = [k["step"] for k in kept[j]
                 if k["ids"] != data.sample_ids("train", bs, block, seed, j, k["step"]).tolist()]
        if wrong:
            bad.append(f"micro-batch {j}: sample ids differ from the data's at steps "
                       f"{wrong[:10]}")
        out["losses"][j] = [k["loss"] for k in kept[j]]
    return bad, out


def final_state(ckpt: str, step: int) -> dict | None:
    """The committed step ``step`` of the trainer: ``{file: sha256}`` of every tensor
    data file its manifest lists (each rank's model and optimizer tensors, raw)."""
    from dlrover_core.checkpoint.manifest import file_digest, read_manifest_file

    d = os.path.join(ckpt, "trainer", f"step_{step:08d}")
    if not os.path.isdir(d):
        return None
    files = read_manifest_file(d)["files"]
    return {k: file_digest(os.path.join(d, k)) for k in files if k.endswith(".data")}


def check_events(events: list[dict], metrics: list[dict], faults: list[dict],
                 summary: dict) -> tuple[list[str], list[float], int]:
    """Every fault followed by its recovery in the events; summary.json against the
    events. Returns ``(violations, recovery seconds, faults recovered)``."""
    bad, rec_s, ok = [], [], 0
    steps = [r for r in metrics if r.get("event") == "step"]
    for f in faults:
        kind, ts = f["kind"], f["ts"]
        if kind in RESTARTING or kind == "kill_master":
            want = ("master_restarted",) if kind == "kill_master" else ("recovery_started",)
            ev = next((e for e in events if e["event"] in want and e["ts"] >= ts), None)
            if ev is None and kind != "kill_master":  # folded into a recovery under way
                ev = next((e for e in events if e["event"] == "instance_failed"
                           and e["ts"] >= ts and e.get("node_id") == f.get("node_id")), None)
            after = next((s for s in steps if ev and s["ts"] > ev["ts"]), None)
            if ev is None:
                bad.append(f"fault {f['i']} ({kind} of {f.get('target')} at {f['t_rel']} s): "
                           f"no {' / '.join(want)} in the events after it")
            elif after is None:
                bad.append(f"fault {f['i']} ({kind}): {ev['event']} at "
                           f"{ev['ts'] - ts:.1f} s after it, but no step after that")
            else:
                ok += 1
                rec_s.append(after["ts"] - ts)
                f["recovery_s"] = round(after["ts"] - ts, 3)  # per fault in the JSON line
        else:  # nothing to restart: the job trains (and commits) on after the fault ended
            named = [e for e in events if e["ts"] >= ts and e["event"] in FAULT_EVENTS[kind]]
            stepped = any(s["ts"] > f["end_ts"] for s in steps) or summary.get(
                "ended_at", 0) > f["end_ts"] and summary.get("status") == "succeeded"
            if kind in ("kill_persister", "disk_full") and not f.get("commit_after"):
                bad.append(f"fault {f['i']} ({kind} at {f['t_rel']} s): no checkpoint committed "
                           "after it")
            elif not stepped:
                bad.append(f"fault {f['i']} ({kind}): no step after it ended")
            elif kind == "disk_full" and not named and not _persist_due(events, f):
                ok += 1  # no save was due for the disk while it was full (the ranks were
                # hung or restarting): nothing hit ENOSPC, nothing to report
            elif FAULT_EVENTS[kind] and not named:
                bad.append(f"fault {f['i']} ({kind} of {f.get('target')} at {f['t_rel']} s): "
                           f"recovered, but no {' / '.join(FAULT_EVENTS[kind])} event reports it")
            else:
                ok += 1
    # summary.json against the events
    classified = collections.Counter(e["action"] for e in events
                                     if e["event"] == "failure_classified" and e["action"] != "fatal")
    restarts = {k: v for k, v in (summary.get("restarts") or {}).items() if k != "total" and v}
    if dict(classified) != restarts:
        bad.append(f"summary.json restarts {restarts} != failure_classified events {dict(classified)}")
    if (summary.get("restarts") or {}).get("total") != sum(classified.values()):
        bad.append(f"summary.json restarts.total {summary.get('restarts')} != "
                   f"{sum(classified.values())} classified failures")
    fin = [e for e in events if e["event"] == "job_finished"]
    if not fin or fin[-1]["steps"] != summary.get("steps") or fin[-1]["status"] != summary.get("status"):
        bad.append(f"job_finished {fin[-1:] } does not match summary.json steps/status "
                   f"{summary.get('steps')}/{summary.get('status')}")
    first: dict[int, float] = {}
    top = -1
    for s in steps:
        if s["step"] > top:
            top = s["step"]
            first.setdefault(s["step"], s["ts"])
    ts = [first[k] for k in sorted(first)]
    gaps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
    if gaps and summary.get("wall_s") and summary.get("goodput") is not None:
        g = min(1.0, len(first) * statistics.median(gaps) / summary["wall_s"])
        if abs(g - summary["goodput"]) > 0.05:
            bad.append(f"summary.json goodput {summary['goodput']} != {g:.4f} from the step events")
    return bad, rec_s, ok


def after_last_step(events: list[dict], faults: list[dict]) -> tuple[list[dict], list[dict]]:
    """Split the injected ``faults`` into those the job met and those made after every
    rank had finished its last step (an ``instance_finished`` of each rank of the last
    attempt before the fault) with no recovery (``recovery_started``,
    ``master_restarted``) after them: a fault that restarts something, made in the
    instant between the last step and the job's end (the injector saw the job running),
    has nothing left to recover. Those count as not injected (the job's other
    invariants, the final commit and the leaks, still hold them). Returns
    ``(met, late)``, each with ``why`` added to the late ones."""
    met, late = [], []
    for f in faults:
        if f["kind"] not in RESTARTING | {"kill_master"}:
            met.append(f)
            continue
        before = [e for e in events if e["ts"] <= f["ts"]]
        started = [e for e in before if e["event"] == "instance_started"]
        ranks = {(e["role"], e["rank"]) for e in started}
        last = max((e["ts"] for e in started), default=0.0)
        finished = {(e["role"], e["rank"]) for e in before
                    if e["event"] == "instance_finished" and e["ts"] >= last}
        recovered = any(e["event"] in ("recovery_started", "master_restarted")
                        and e["ts"] >= f["ts"] for e in events)
        if ranks and finished >= ranks and not recovered:
            late.append(dict(f, why="made after every rank had finished its last step "
                                    "(nothing left to recover)"))
        else:
            met.append(f)
    return met, late


def _persist_due(events: list[dict], f: dict) -> bool:
    """Whether a save due for the disk (``checkpoint_saved`` of a step that is a multiple
    of :data:`PERSIST_EVERY`) came while the fault ``f`` lasted (1 s after its start to
    2 s before its end: a persist under way at either edge may not meet it)."""
    return any(e["event"] == "checkpoint_saved" and e.get("step", 1) % PERSIST_EVERY == 0
               and f["ts"] + 1 <= e["ts"] <= f["end_ts"] - 2 for e in events)


def leaks(ch: Chaos, jobs: list[str], dirs: list[str]) -> list[str]:
    """After cluster down: processes of the cluster, flash buffers of ``jobs``, run
    locks still held, temp step folders left in ``dirs``."""
    from dlrover_plugin_flashckpt import shm

    bad = [f"process left after cluster down: {p}" for p in ch.leftovers()]
    bad += [f"shm buffer left: {p}" for job in jobs
            for p in shm.list_segments("/dev/shm", shm.job_prefix(job))]
    from dlrover_core.master.dir_lock import LOCK_NAME

    from dlrover_core.master.dir_lock import live_holder

    for d in dirs:
        for root, names, files in os.walk(d):
            if LOCK_NAME in files and live_holder(root) is not None:
                bad.append(f"run lock still held: {root} by {live_holder(root)}")
            bad += [f"temp step folder left: {os.path.join(root, n)}" for n in names
                    if n.startswith(".step_") and n.endswith(".tmp")]
    return bad


def keep_evidence(work: str, max_bytes: int = 1 << 20) -> str:
    """Copy what a violation needs from the checkpoint folders (``ckpt-*`` under
    ``work``, on tmpfs mounts that the cleanup removes) into ``work/evidence/``: a
    listing (path, bytes, mtime of every file and folder) and every file of at most
    ``max_bytes`` (markers, manifests, intents, ``latest``, locks; not the shards).
    The job folders (events, metrics, summary, sample logs) stay where they are.
    Returns the evidence folder."""
    out = os.path.join(work, "evidence")
    os.makedirs(out, exist_ok=True)
    rows = []
    for d in sorted(os.listdir(work)):
        if not d.startswith("ckpt-"):
            continue
        for root, names, files in os.walk(os.path.join(work, d)):
            for n in sorted(names + files):
                p = os.path.join(root, n)
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                rel = os.path.relpath(p, work)
                rows.append(f"{rel}\t{st.st_size}\t{st.st_mtime:.3f}"
                            f"{'/' if os.path.isdir(p) else ''}")
                if n in files and st.st_size <= max_bytes:
                    os.makedirs(os.path.dirname(os.path.join(out, rel)), exist_ok=True)
                    try:
                        shutil.copy2(p, os.path.join(out, rel))
                    except OSError:
                        pass
    with open(os.path.join(out, "listing.tsv"), "w") as f:
        f.write("".join(r + "\n" for r in rows))
    return out


# ------------------------------------------------------------------ main
CAL_STEPS = 800  # the calibration job's max_steps
# the fault-free run's share of --minutes: 1, as the faults slow a run (only a 3-minute
# run, on a machine whose load fell between its two jobs, was ever shorter with faults),
# and at least --minutes is the promise. The runs with faults took
# 1.13-1.76 times their fault-free run (seeds 1-6), so no smaller share keeps it: at 0.6
# seed 4 lasted 22 minutes with faults, at 0.7 seeds 5 and 6 lasted 29 and 21
FAULT_FREE_SHARE = 1.0


def steady_step_s(ts: list[float]) -> float:
    """Seconds a step over the second half of the steps' timestamps ``ts`` (s): the mean,
    so that the saves and commits among the steps count. The first steps of a job run
    while the cluster's other processes (persisters, the replica, the master's first
    reports) still start: the median step of a 100-step job was 0.026-0.031 s where the
    fault-free runs of 35,000-39,000 steps took 0.017-0.019 s a step (seeds 2 and 3),
    and the runs with faults lasted 15-20 of their 30 minutes.

    Raises ValueError with fewer than 4 timestamps."""
    if len(ts) < 4:
        raise ValueError(f"steady_step_s: {len(ts)} step timestamps; allowed: at least 4")
    mid = len(ts) // 2
    return (ts[-1] - ts[mid]) / (len(ts) - 1 - mid)


def calibrate(ch: Chaos, minutes: float) -> tuple[int, float]:
    """Steps for a fault-free run of ``FAULT_FREE_SHARE`` of ``minutes``, from
    :func:`steady_step_s` of a ``CAL_STEPS``-step job; returns ``(steps, step_s)``.
    Raises RuntimeError when the calibration job reported too few steps."""
    jd = os.path.join(ch.work, "job-cal")
    ckpt = os.path.join(ch.work, "ckpt-cal")
    out = run_to_end(ch, f"chaos-cal-{ch.seed}", jd,
                     ch.overrides(f"chaos-cal-{ch.seed}", CAL_STEPS, ckpt,
                                  os.path.join(jd, "samples")))
    ts = [r["ts"] for r in read_jsonl(os.path.join(jd, "metrics.jsonl")) if r.get("event") == "step"]
    try:
        step_s = steady_step_s(ts)
    except ValueError as e:
        raise RuntimeError(f"calibration job (rc {out['rc']}): {e}") from None
    q, last = max(1, len(ts) // 4), len(ts) - 1  # the step time by quarter, for the log
    quarters = [round((ts[min(k + q, last)] - ts[k]) / (min(k + q, last) - k), 4)
                for k in range(0, last, q)]
    steps = int(FAULT_FREE_SHARE * minutes * 60 / step_s) // PERSIST_EVERY * PERSIST_EVERY
    log(f"calibration: rc {out['rc']}, {len(ts)} steps, s a step by quarter {quarters}; "
        f"second half {step_s:.4f} s a step -> {steps} steps")
    return max(steps, 10 * PERSIST_EVERY), step_s


#: the version of a --save-reference file's fields
REFERENCE_FORMAT = 2


#: steps per digest of the losses in a reference (:func:`loss_digests`)
LOSS_BLOCK = 1000


def loss_digests(losses: dict, block: int = LOSS_BLOCK) -> dict[str, list[str]]:
    """``{micro-batch: [sha256 of the exact losses (``repr``) of steps k*block ..]}``: what a
    reference keeps of every step's loss, a few KB instead of megabytes; a differing
    digest names the block where a run left the reference."""
    import hashlib

    return {str(j): [hashlib.sha256("\n".join(map(repr, v[i:i + block])).encode()).hexdigest()
                     for i in range(0, len(v), block)]
            for j, v in sorted(losses.items(), key=lambda kv: int(kv[0]))}


def fault_free(ch: Chaos, work: str, steps: int, names: list[str], bs: int,
               block: int) -> dict:
    """Run the job of ``steps`` steps once without faults (its name appended to
    ``names``) and return what the run with faults is checked against: ``steps``,
    ``job_seed``, ``elastic``, ``window_s`` (seconds from its first step to its end),
    ``wall_s``, ``final_state`` (:func:`final_state`), ``loss_digests`` (every
    micro-batch's loss at every step, :func:`loss_digests`) and ``loss_block``,
    ``world_sizes``, ``violations`` (its own: it must succeed and replay clean), ``ran_at``
    (unix s), ``format``."""
    ref_ckpt, _ = ch.ckpt_fs("ckpt-ref")
    ref_dir = os.path.join(work, "job-ref")
    names.append(f"chaos-ref-{ch.seed}")
    log(f"fault-free run: {steps} steps")
    ref = run_to_end(ch, names[-1], ref_dir,
                     ch.overrides(names[-1], steps, ref_ckpt, os.path.join(ref_dir, "samples")))
    first = next((r["ts"] for r in read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
                  if r.get("event") == "step"), ref["t0"])
    bad = []
    if ref["rc"] != 0 or (ref["summary"] or {}).get("status") != "succeeded":
        bad.append(f"the fault-free run did not succeed: rc {ref['rc']}")
    replay_bad, rep = replay_samples(os.path.join(ref_dir, "samples"), 2, steps, ch.seed, bs,
                                     block)
    log(f"fault-free run: rc {ref['rc']}")
    return {"format": REFERENCE_FORMAT, "steps": steps, "job_seed": ch.seed,
            "elastic": ch.elastic, "window_s": max(60.0, ref["t_end"] - first),
            "wall_s": (ref["summary"] or {}).get("wall_s"), "ran_at": round(time.time(), 1),
            "final_state": final_state(ref_ckpt, steps),
            "loss_digests": loss_digests(rep["losses"]), "loss_block": LOSS_BLOCK,
            "world_sizes": rep["world_sizes"], "violations": bad + replay_bad}


class Stopped(BaseException):
    """SIGTERM or SIGINT reached the harness: the run ends early, its cluster goes down
    and what it leaves (flash buffers, mounts, its work folder) is removed."""


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0,
                    help="minutes of the fault-free run (about; the run with faults lasts "
                         "longer: 1.13-1.76 times here; default 30)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the schedule and the job")
    ap.add_argument("--faults", default=",".join(KINDS),
                    help=f"comma-separated kinds to draw from (default all: {','.join(KINDS)})")
    ap.add_argument("--count", type=int, default=None,
                    help="faults in the schedule (default: one per minute, at least 3)")
    ap.add_argument("--steps", type=int, default=None,
                    help="the job's max_steps (default: sized by a calibration job)")
    ap.add_argument("--work", default=None, help="keep the jobs' folders here")
    ap.add_argument("--elastic", action="store_true",
                    help="the trainer role elastic over the 2 worker nodes: a lost node not "
                         "replaced within 10 s shrinks it, its return grows it back; faults "
                         "also during that grow (trigger resize)")
    ap.add_argument("--job-seed", type=int, default=None,
                    help="the job's config.seed (default: --seed); runs of one job seed can "
                         "share one fault-free run (--save-reference, --reference)")
    ap.add_argument("--save-reference", default=None, metavar="FILE",
                    help="write the fault-free run's results (steps, job seed, final state "
                         "digests, every micro-batch's losses) to FILE (JSON)")
    ap.add_argument("--reference", default=None, metavar="FILE",
                    help="take the fault-free run from FILE (written by --save-reference "
                         "for the same job seed and --elastic) instead of running it")
    args = ap.parse_args(argv)
    job_seed = args.seed if args.job_seed is None else args.job_seed
    reference = None
    if args.reference:
        try:
            with open(args.reference) as f:
                reference = json.load(f)
        except (OSError, ValueError) as e:
            ap.error(f"--reference {args.reference}: {e}")
        for key, mine in (("job_seed", job_seed), ("elastic", args.elastic),
                          ("format", REFERENCE_FORMAT)):
            if reference.get(key) != mine:
                ap.error(f"--reference {args.reference}: its {key} is "
                         f"{reference.get(key)!r}, this run's {mine!r}; allowed: the same "
                         "(give --job-seed and --elastic as when it was saved)")
        if args.steps is not None and args.steps != reference["steps"]:
            ap.error(f"--steps {args.steps}: the reference ran {reference['steps']} steps")
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    wrong = [k for k in kinds if k not in KINDS]
    if wrong or not kinds:
        ap.error(f"--faults: {wrong or args.faults!r} not allowed; allowed: {', '.join(KINDS)}")
    if args.minutes <= 0:
        ap.error(f"--minutes: {args.minutes}; allowed: a number > 0")
    if args.steps is not None and (args.steps < PERSIST_EVERY or args.steps % PERSIST_EVERY):
        ap.error(f"--steps: {args.steps}; allowed: a multiple of {PERSIST_EVERY} (the final "
                 "step is committed to disk)")
    os.chdir(ROOT)
    work = args.work or tempfile.mkdtemp(prefix="chaos-", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    t_start = time.time()
    ch = Chaos(work, job_seed, elastic=args.elastic)
    violations: list[str] = []
    result: dict = {"status": None, "faults_injected": 0, "faults_recovered": 0,
                    "violations": violations, "goodput": None, "steps_redone": None,
                    "recovery_s": {"median": None, "max": None}, "seed": args.seed,
                    "job_seed": job_seed, "elastic": args.elastic,
                    "reference": args.reference}
    names: list[str] = []
    # a run started in the background ignores SIGINT unless asked, and SIGTERM would
    # skip the cleanup below: both stop it the same way
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    stopped = None
    bs, block = 8, 32
    try:
        if reference is None:
            steps = args.steps or calibrate(ch, args.minutes)[0]
            reference = fault_free(ch, work, steps, names, bs, block)
            if args.save_reference:
                from dlrover_core.atomic_io import atomic_write_json

                atomic_write_json(args.save_reference, reference)
                log(f"fault-free run saved as the reference {args.save_reference}")
        else:
            log(f"fault-free run: from {args.reference} ({reference['steps']} steps, job seed "
                f"{job_seed}, run {reference['ran_at']})")
        steps, window = reference["steps"], reference["window_s"]
        violations += [f"fault-free run: {v}" for v in reference["violations"]]
        n = args.count or max(3, round(args.minutes))
        schedule = make_schedule(args.seed, kinds, window, n, steps, elastic=args.elastic)
        log(f"fault-free run: {window:.0f} s of steps; schedule: "
            + ", ".join(f"{f['kind']}@step {f['at_step']}/{f['trigger']}" for f in schedule))
        # the run with faults
        ckpt, mounted = ch.ckpt_fs("ckpt-chaos")
        job_dir = os.path.join(work, "job-chaos")
        names.append(f"chaos-{args.seed}")
        holder: dict = {}

        def faults(proc: subprocess.Popen) -> None:
            inj = holder["inj"] = Injector(ch, names[-1], job_dir, ckpt, proc, mounted)
            inj.run(schedule)

        run = run_to_end(ch, names[-1], job_dir,
                         ch.overrides(names[-1], steps, ckpt, os.path.join(job_dir, "samples")),
                         on_running=faults)
        inj = holder.get("inj")
        events = read_jsonl(os.path.join(job_dir, "events.jsonl"))
        done, late = after_last_step(events, inj.done if inj else [])
        if inj:
            inj.skipped += late
        summary = run["summary"] or {}
        result.update(status=summary.get("status"), faults_injected=len(done),
                      goodput=summary.get("goodput"), steps=steps,
                      faults_scheduled=len(schedule),
                      faults=[{k: f.get(k) for k in ("i", "kind", "trigger", "t_rel", "target",
                                                     "duration_s")} for f in done],
                      skipped=[{k: f.get(k) for k in ("i", "kind", "why")}
                               for f in (inj.skipped if inj else schedule)],
                      restarts=summary.get("restarts"), wall_s=summary.get("wall_s"),
                      ref_wall_s=reference["wall_s"])
        # invariants
        if run["rc"] != 0 or summary.get("status") != "succeeded":
            violations.append(f"job did not succeed: rc {run['rc']}, status "
                              f"{summary.get('status')}, error {summary.get('error')}")
        bad, rep = replay_samples(os.path.join(job_dir, "samples"), 2, steps, job_seed, bs,
                                  block)
        violations += bad
        rep_ref = {"world_sizes": reference["world_sizes"]}
        result.update(world_sizes=rep["world_sizes"])
        a, b = reference["final_state"], final_state(ckpt, steps)
        if a is None or b is None:
            violations.append(f"final step {steps} not committed: fault-free {a is not None}, "
                              f"with faults {b is not None}")
        elif rep["world_sizes"][-1:] != rep_ref["world_sizes"][-1:]:
            # saved by another number of ranks: other files; the losses of every step
            # (below) are compared instead, and the state through them
            result["final_state_compared"] = (
                f"through the losses: saved at world size {rep['world_sizes'][-1:]} against "
                f"{rep_ref['world_sizes'][-1:]}")
        elif a != b:
            violations.append(f"final model state differs from the fault-free run's: files "
                              f"{sorted(k for k in a if a.get(k) != b.get(k))}")
        mine = loss_digests(rep["losses"], int(reference["loss_block"]))
        for j, want in sorted(reference["loss_digests"].items()):
            got = mine.get(j, [])
            diff = [k for k in range(max(len(want), len(got)))
                    if k >= len(want) or k >= len(got) or want[k] != got[k]]
            if diff:
                b = int(reference["loss_block"])
                violations.append(f"micro-batch {j}: loss differs from the fault-free run's "
                                  f"in {len(diff)} block(s) of {b} steps, first steps "
                                  f"{diff[0] * b}..{(diff[0] + 1) * b - 1}")
        if (summary.get("checkpoint_steps") or {}).get("trainer") != steps:
            violations.append(f"summary.json checkpoint_steps {summary.get('checkpoint_steps')}"
                              f" != {steps}")
        metrics = read_jsonl(os.path.join(job_dir, "metrics.jsonl"))
        bad, rec_s, ok = check_events(events, metrics, done, summary)
        violations += bad
        for row, f in zip(result["faults"], done):
            row["recovery_s"] = f.get("recovery_s")  # fault to the first step after its recovery
        counts = collections.Counter(r["step"] for r in metrics if r.get("event") == "step")
        result.update(faults_recovered=ok, steps_redone=sum(c - 1 for c in counts.values()),
                      samples_rolled_back=rep["rolled_back"],
                      recovery_s={"median": round(statistics.median(rec_s), 3) if rec_s else None,
                                  "max": round(max(rec_s), 3) if rec_s else None,
                                  "n": len(rec_s)})
    except Stopped as e:
        stopped = str(e)
        log(f"stopped by {stopped}: taking the cluster down and cleaning up")
        result["status"] = "stopped"
        violations.append(f"stopped by {stopped} before the end")
    except Exception as e:  # noqa: BLE001 - reported as a violation, the cluster still goes down
        import traceback

        traceback.print_exc()
        violations.append(f"chaos harness error: {type(e).__name__}: {e}")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):   # the cleanup is not interrupted
            signal.signal(sig, signal.SIG_IGN)
        ch.down()
        time.sleep(2)
        violations += leaks(ch, names, [os.path.join(work, d) for d in os.listdir(work)
                                        if d.startswith(("job-", "ckpt-"))])
        if stopped:   # a job cut off mid-run leaves its flash buffers: remove them
            from dlrover_plugin_flashckpt import hygiene

            for name in [f"chaos-cal-{job_seed}", *names]:
                hygiene.remove_job("/dev/shm", name)
        kept = bool(violations) and not stopped  # a run's evidence, as Jepsen keeps its history
        if kept:
            keep_evidence(work)
        ch.unmount_all()  # after the check: the checkpoint folders are on these
        if kept:
            result["work"] = work
            log(f"violations: the run's files are kept in {work} (evidence/: the checkpoint "
                f"folders' listing and small files)")
        elif not args.work:
            shutil.rmtree(work, ignore_errors=True)
    result.update(minutes=args.minutes, total_s=round(time.time() - t_start, 1),
                  faults_kinds=kinds)
    print(json.dumps(result))
    return 0 if not violations else 1


if __name__ == "__main__":
    sys.exit(main())
