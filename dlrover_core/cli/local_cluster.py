"""A Ray cluster of several nodes on this machine, each a separate ``ray start`` process.

``ray start --head`` on one machine and ``ray start --address HEAD`` on the others,
here on one machine: each node has its own ``--temp-dir`` (logs, sockets, session),
ports (picked free at start) and ``--num-cpus``, and runs as ``ray start --block`` in a
session of its own, so the node is one process group: stopping the node is a SIGTERM
to its ``ray start`` (which stops the node's Ray processes), then a SIGKILL to the
group for anything left; losing the node is a SIGKILL to the group.

Token authentication stays on: :func:`up` writes a fresh 256-bit token to
``<state dir>/auth_token`` (mode 0600) and starts every node with ``RAY_AUTH_MODE=token``
and ``RAY_AUTH_TOKEN_PATH`` naming it; clients need the same two (:func:`client_env`).
The state file ``<state dir>/cluster.json`` records the head address, the token path
and, per node, its name, PID/process group, temp dir, ports, CPUs and Ray node id, so
that :func:`down` stops exactly these processes and nothing else (never ``ray stop``,
which stops every Ray process on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from dlrover_core.cli.cluster_logs import node_tail
from dlrover_core.pids import descendants, group_pids, pid_alive
from dlrover_core.ports import free_port, free_ports

STATE = "cluster.json"
TOKEN_FILE = "auth_token"
DEFAULT_DIR = os.path.join(".dlrover", "cluster")
HOST = "127.0.0.1"
#: times :func:`up` starts again a worker node whose ``ray start`` ended before it joined
NODE_START_RETRIES = 3


class ClusterError(RuntimeError):
    """A local cluster could not be started, found or stopped."""


def state_dir(path: str | None = None) -> str:
    """The state directory: ``path``, else ``$DLROVER_CLUSTER_DIR``, else
    ``./.dlrover/cluster``."""
    return os.path.abspath(path or os.environ.get("DLROVER_CLUSTER_DIR") or DEFAULT_DIR)


def read_state(directory: str | None = None) -> dict | None:
    """The recorded cluster of ``directory`` (see :func:`state_dir`), or ``None``."""
    path = os.path.join(state_dir(directory), STATE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_state(directory: str, state: dict) -> None:
    path = os.path.join(directory, STATE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f, indent=1)
    os.replace(path + ".tmp", path)


def client_env(state: dict) -> dict[str, str]:
    """The variables a client (or another node) needs to join the cluster of ``state``:
    ``RAY_ADDRESS``, ``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``."""
    return {"RAY_ADDRESS": state["address"], "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": state["token_path"]}


def _ray_start(args: list[str], env: dict[str, str], log_path: str,
               wrap: list[str] | None = None) -> subprocess.Popen:
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [*(wrap or []), ray_bin if os.path.exists(ray_bin) else "ray", "start", "--block",
           *args]
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _node_ports() -> dict[str, int]:
    """Own ports for one node: several helpers' clusters share this machine, and Ray's
    defaults (10001, 8265, 52365, ...) would collide."""
    names = ("node-manager-port", "object-manager-port", "runtime-env-agent-port",
             "dashboard-agent-grpc-port", "dashboard-agent-listen-port", "metrics-export-port",
             "ray-client-server-port", "dashboard-port")
    return dict(zip(names, free_ports(len(names))))


def _start_node(directory: str, name: str, env: dict[str, str], num_cpus: int,
                head_port: int | None = None, address: str | None = None,
                temp_root: str | None = None, wrap: list[str] | None = None) -> dict:
    temp_dir = os.path.join(temp_root, name)  # short: Ray's socket paths must fit 107 bytes
    os.makedirs(temp_dir, exist_ok=True)
    ports = _node_ports()
    if head_port is None:  # the head's own two
        del ports["ray-client-server-port"], ports["dashboard-port"]
    args = [f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--node-ip-address={HOST}", "--disable-usage-stats"]
    args += [f"--{k}={v}" for k, v in ports.items()]
    if head_port is not None:
        ports["port"] = head_port
        args += ["--head", f"--port={head_port}", "--include-dashboard=false"]
    else:
        args.append(f"--address={address}")
    log_path = os.path.join(directory, f"{name}.log")
    proc = _ray_start(args, env, log_path, wrap)
    return {"name": name, "pid": proc.pid, "pgid": proc.pid, "temp_dir": temp_dir,
            "num_cpus": num_cpus, "ports": ports, "log": log_path, "node_id": None,
            "head": head_port is not None}


def _wait_port(port: int, node: dict, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not pid_alive(node["pid"]):
            raise ClusterError(f"node {node['name']} exited while starting; its log: "
                               f"{node_tail(node)}")
        try:
            socket.create_connection((HOST, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise ClusterError(f"node {node['name']}: port {port} not open after {timeout_s:.0f} s; "
                       f"its log: {node['log']}")


def _node_table(state: dict) -> list[dict]:
    """``ray.nodes()`` of the cluster, read by a short-lived subprocess (this process
    may already be connected to another cluster, or should stay unconnected), from the
    line after a marker (Ray may print a raylet's notice after it on a busy machine)."""
    mark = "dlrover-node-table: "
    code = ("import json, ray; ray.init(address=%r, logging_level='ERROR', "
            "include_dashboard=False, log_to_driver=False); "
            "print(%r + json.dumps(ray.nodes()), flush=True); ray.shutdown()"
            % (state["address"], mark))
    env = dict(os.environ, **client_env(state))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise ClusterError(f"could not read the node table of {state['address']}:\n"
                           f"{out.stderr[-2000:]}")
    rows = [ln[len(mark):] for ln in out.stdout.splitlines() if ln.startswith(mark)]
    if not rows:
        raise ClusterError(f"no node table of {state['address']} in:\n{out.stdout[-2000:]}")
    return json.loads(rows[-1])


def wait_for_nodes(state: dict, timeout_s: float = 120.0) -> dict:
    """Wait until every recorded, running node is alive in Ray's node table; fill in
    each node's ``node_id`` (matched by its node-manager port) and save the state.

    Raises:
        ClusterError: a node exited, or is not alive after ``timeout_s`` seconds.
    """
    deadline = time.time() + timeout_s
    want = [n for n in state["nodes"] if pid_alive(n["pid"])]
    while True:
        for n in want:
            if not pid_alive(n["pid"]):
                raise ClusterError(f"node {n['name']} exited; its log: {node_tail(n)}")
        table = {r["NodeManagerPort"]: r for r in _node_table(state) if r["Alive"]}
        for n in want:
            row = table.get(n["ports"]["node-manager-port"])
            if row is not None:
                n["node_id"] = row["NodeID"]
        if all(n["node_id"] for n in want):
            _write_state(state["dir"], state)
            return state
        if time.time() > deadline:
            late = [n for n in want if not n["node_id"]]
            raise ClusterError(f"nodes {[n['name'] for n in late]} did not join {state['address']}"
                               f" in {timeout_s:.0f} s; " + "\n".join(map(node_tail, late)))
        time.sleep(1.0)


def _node_env(state: dict, head: bool = False) -> dict[str, str]:
    """The environment of a node's ``ray start``: the token; for the head of a
    ``gcs_ft`` cluster also ``RAY_REDIS_ADDRESS`` and a storage namespace of its own."""
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=state["token_path"])
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    if head and state.get("redis"):
        env["RAY_REDIS_ADDRESS"] = f"{HOST}:{state['redis']['port']}"
        env["RAY_external_storage_namespace"] = os.path.basename(state["temp_root"])
    return env


def restart_head(state: dict, timeout_s: float = 120.0) -> dict:
    """Lose the head at once (SIGKILL to its process group) and start a new head on the
    same GCS port with the same Redis, its temp dir emptied first (else ``ray start``
    takes the old GCS's address recorded there for a running one); wait until the
    recorded nodes that still run are alive in its node table. Returns its record.

    Raises:
        ClusterError: the cluster was not started with ``gcs_ft``, or the new head or a
            worker node did not come back within ``timeout_s`` seconds.
    """
    if not state.get("redis"):
        raise ClusterError("restart_head needs a cluster started with --gcs-ft (without "
                           "Redis the new head would know nothing of the old one)")
    old = next(n for n in state["nodes"] if n["head"])
    kill_node(state, old["name"])
    deadline = time.time() + 30
    while group_pids(old["pgid"]) and time.time() < deadline:
        time.sleep(0.2)
    shutil.rmtree(old["temp_dir"], ignore_errors=True)
    head = _start_node(state["dir"], "head", _node_env(state, head=True), old["num_cpus"],
                       head_port=old["ports"]["port"], temp_root=state["temp_root"])
    state["nodes"] = [head] + [n for n in state["nodes"] if not n["head"]]
    _write_state(state["dir"], state)
    _wait_port(head["ports"]["port"], head, timeout_s)
    wait_for_nodes(state, timeout_s)
    return head


def _start_redis(directory: str, timeout_s: float) -> dict:
    """A ``redis-server`` for the GCS (in memory, no snapshots), its own process group."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ClusterError("--gcs-ft needs redis-server on PATH (make setup installs it)")
    port = free_port()
    log_path = os.path.join(directory, "redis.log")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([exe, "--port", str(port), "--bind", HOST, "--save", "",
                                 "--appendonly", "no"], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    redis = {"name": "redis", "pid": proc.pid, "pgid": proc.pid, "port": port,
             "log": log_path}
    _wait_port(port, redis, timeout_s)
    return redis


def up(nodes: int = 2, cpus_per_node: int = 2, head_cpus: int = 0,
       directory: str | None = None, token_path: str | None = None,
       timeout_s: float = 120.0, gcs_ft: bool = False) -> dict:
    """Start a head and ``nodes`` worker nodes; return the saved state.

    Args:
        nodes: worker nodes (>= 0), each ``ray start --address`` with ``cpus_per_node`` CPUs.
        head_cpus: CPUs of the head (default 0: the head runs the JobMaster, no ranks).
        directory: the state directory (:func:`state_dir`).
        token_path: an existing token file to use instead of a new one.
        gcs_ft: start a ``redis-server`` first and the head with ``RAY_REDIS_ADDRESS``
            naming it (Ray's GCS fault tolerance: the GCS keeps its tables in Redis).

    Raises:
        ValueError: ``nodes`` < 0 or ``cpus_per_node`` < 1.
        ClusterError: a cluster of this state directory is still running, or a node
            failed to start (the nodes already started are stopped again). A worker
            node whose ``ray start`` ends before it joins is started again, with new
            ports, up to :data:`NODE_START_RETRIES` times (CI lost nodes to a raylet
            exiting with its agent, to Ray's 30 s wait for it to register, and a retry).
    """
    if nodes < 0:
        raise ValueError(f"--nodes: {nodes!r}; give 0 or more worker nodes")
    if cpus_per_node < 1:
        raise ValueError(f"--cpus-per-node: {cpus_per_node!r}; give 1 or more")
    directory = state_dir(directory)
    old = read_state(directory)
    if old and any(pid_alive(n["pid"]) for n in old["nodes"]):
        raise ClusterError(f"a cluster is already up at {old['address']} (state {directory}); "
                           "`dlrover cluster down` first, or use another --dir")
    os.makedirs(directory, exist_ok=True)
    if token_path is None:
        token_path = os.path.join(directory, TOKEN_FILE)
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    elif not os.path.isfile(token_path):
        raise ClusterError(f"--token-file: {token_path!r} does not exist")
    head_port = free_port()
    state: dict[str, Any] = {
        "dir": directory, "address": f"{HOST}:{head_port}",
        "token_path": os.path.abspath(token_path),
        "temp_root": tempfile.mkdtemp(prefix="dlrc-", dir="/tmp"), "nodes": []}
    try:
        if gcs_ft:
            state["redis"] = _start_redis(directory, timeout_s)
            _write_state(directory, state)
        env = _node_env(state, head=True)
        head = _start_node(directory, "head", env, head_cpus, head_port=head_port,
                           temp_root=state["temp_root"])
        state["nodes"].append(head)
        _write_state(directory, state)
        _wait_port(head_port, head, timeout_s)
        for _ in range(nodes):
            add_node(state, cpus_per_node, wait=False)
        for again in range(NODE_START_RETRIES, -1, -1):
            try:
                return wait_for_nodes(state, timeout_s)
            except ClusterError as e:  # worker nodes whose `ray start` ended: again
                dead = [n for n in state["nodes"]
                        if not n["head"] and not pid_alive(n["pid"])]
                if not again or not dead or not pid_alive(head["pid"]):
                    raise
                print(f"warning: {e}\nstarting {[n['name'] for n in dead]} again",
                      file=sys.stderr)
                for n in dead:
                    _stop_node(n, 0.0)  # what is left of its group (its agents)
                    shutil.rmtree(n["temp_dir"], ignore_errors=True)
                    state["nodes"].remove(n)
                    add_node(state, cpus_per_node, wait=False)
    except BaseException:
        down(directory)
        raise


def add_node(state: dict, num_cpus: int = 2, wait: bool = True,
             timeout_s: float = 120.0, wrap: list[str] | None = None) -> dict:
    """Start one more worker node (``ray start --address``) in the cluster of ``state``;
    return its record (with ``node_id`` when ``wait``). ``wrap``: a command that execs
    its arguments (e.g. ``["unshare", "--mount", "--propagation", "private"]``: a node
    with a mount namespace of its own), put before ``ray start``; it must keep the PID."""
    taken = {n["name"] for n in state["nodes"]}
    i = next(k for k in range(1, len(taken) + 2) if f"worker-{k}" not in taken)
    node = _start_node(state["dir"], f"worker-{i}", _node_env(state), num_cpus,
                       address=state["address"], temp_root=state["temp_root"], wrap=wrap)
    state["nodes"].append(node)
    _write_state(state["dir"], state)
    if wait:
        wait_for_nodes(state, timeout_s)
    return node


def kill_node(state: dict, name: str) -> list[int]:
    """Lose node ``name`` at once: SIGKILL every process of its process group (its
    ``ray start``, raylet, agents and the workers it started). Returns the PIDs."""
    node = next((n for n in state["nodes"] if n["name"] == name), None)
    if node is None:
        raise ClusterError(f"no node {name!r}; nodes: {[n['name'] for n in state['nodes']]}")
    pids = group_pids(node["pgid"])
    try:
        os.killpg(node["pgid"], signal.SIGKILL)
    except ProcessLookupError:
        pass
    return pids


def _stop_node(node: dict, grace_s: float) -> None:
    if pid_alive(node["pid"]):
        try:
            os.kill(node["pid"], signal.SIGTERM)  # `ray start --block` stops its processes
        except ProcessLookupError:
            pass
    deadline = time.time() + grace_s
    while time.time() < deadline and group_pids(node["pgid"]):
        time.sleep(0.2)
    if group_pids(node["pgid"]):
        try:
            os.killpg(node["pgid"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def down(directory: str | None = None, grace_s: float = 10.0, keep_temp: bool = False) -> dict:
    """Stop the recorded cluster: worker nodes first, then the head; only the recorded
    process groups and the processes they started (Ray's workers, in sessions of their
    own) are signalled: the workers still alive ``grace_s`` s after their nodes stopped
    (a worker notices its raylet's end late on a busy machine) get SIGKILL. Removes the
    state file (and the nodes' temp dirs unless ``keep_temp``). Returns the state.

    Raises:
        ClusterError: no cluster is recorded in the state directory.
    """
    import psutil

    directory = state_dir(directory)
    state = read_state(directory)
    if state is None:
        raise ClusterError(f"no cluster recorded in {directory} (no {STATE})")
    workers = descendants([n["pgid"] for n in state["nodes"]])
    for node in sorted(state["nodes"], key=lambda n: n["head"]):
        _stop_node(node, grace_s)
    if state.get("redis"):
        _stop_node(state["redis"], grace_s)
    for p in psutil.wait_procs(workers, timeout=grace_s)[1]:
        try:
            p.kill()
        except psutil.Error:
            pass
    if not keep_temp:
        shutil.rmtree(state["temp_root"], ignore_errors=True)
    os.remove(os.path.join(directory, STATE))
    return state


def node_rows(state: dict) -> list[dict]:
    """One row per recorded node: name, head?, pid, alive, CPUs, node id, temp dir."""
    return [{"name": n["name"], "head": n["head"], "pid": n["pid"],
             "alive": pid_alive(n["pid"]), "num_cpus": n["num_cpus"], "node_id": n["node_id"],
             "temp_dir": n["temp_dir"]}
            for n in state["nodes"]]
