"""``dlrover cluster up|down|add|env|status``: a Ray cluster of several ``ray start``
nodes on this machine (:mod:`dlrover_core.cli.local_cluster`).

    dlrover cluster up [--nodes N] [--cpus-per-node C] [--head-cpus H] [--dir DIR] [--gcs-ft]
    dlrover cluster add [--cpus C] [--dir DIR]      one more worker node
    dlrover cluster env [--dir DIR]                 `export` lines for clients
    dlrover cluster status [--dir DIR] [--json]
    dlrover cluster down [--dir DIR] [--keep-temp]

``DIR`` defaults to ``$DLROVER_CLUSTER_DIR`` or ``./.dlrover/cluster``.
"""

from __future__ import annotations

import argparse
import shlex

from dlrover_core.cli import local_cluster as lc
from dlrover_core.cli.output import console_for, print_json, print_table

err = console_for(stderr=True)


def _state(args: argparse.Namespace) -> dict:
    state = lc.read_state(args.dir)
    if state is None:
        raise lc.ClusterError(f"no cluster recorded in {lc.state_dir(args.dir)}; "
                              "`dlrover cluster up` first")
    return state


def _exports(state: dict) -> str:
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in lc.client_env(state).items())


def cmd_up(args: argparse.Namespace) -> int:
    state = lc.up(args.nodes, args.cpus_per_node, args.head_cpus, args.dir, args.token_file,
                  gcs_ft=args.gcs_ft)
    err.print(f"cluster up: head {state['address']}, {args.nodes} worker node(s) of "
              f"{args.cpus_per_node} CPU(s); state {state['dir']}", highlight=False)
    err.print("clients join with these variables (or `eval $(dlrover cluster env)`):")
    print(_exports(state))
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    node = lc.add_node(_state(args), args.cpus)
    err.print(f"node {node['name']} joined: node id {node['node_id']}", highlight=False)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    print(_exports(_state(args)))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    state = _state(args)
    rows = lc.node_rows(state)
    if args.json:
        print_json({"address": state["address"], "nodes": rows})
        return 0
    print_table(("name", "head", "pid", "alive", "cpus", "node id", "temp dir"),
                ((r["name"], "yes" if r["head"] else "", r["pid"], r["alive"],
                  r["num_cpus"], (r["node_id"] or "-")[:12], r["temp_dir"]) for r in rows),
                title=f"cluster {state['address']}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    state = lc.down(args.dir, keep_temp=args.keep_temp)
    err.print(f"cluster {state['address']} stopped ({len(state['nodes'])} node(s))",
              highlight=False)
    return 0


def _run(func):
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (lc.ClusterError, ValueError) as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False)
            return 2
    return wrapped


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="a Ray cluster of several `ray start` nodes on this "
                       "machine")
    csub = p.add_subparsers(dest="sub", required=True)

    def common(s: argparse.ArgumentParser) -> None:
        s.add_argument("--dir", default=None, help="state directory (default "
                       "$DLROVER_CLUSTER_DIR or ./.dlrover/cluster)")

    u = csub.add_parser("up", help="start a head and worker nodes")
    u.add_argument("--nodes", type=int, default=2, help="worker nodes (default 2)")
    u.add_argument("--cpus-per-node", type=int, default=2, help="CPUs of each worker node")
    u.add_argument("--head-cpus", type=int, default=0,
                   help="CPUs of the head node (default 0: it runs the JobMaster only)")
    u.add_argument("--token-file", default=None,
                   help="use this token file instead of a new one (mode 0600)")
    u.add_argument("--gcs-ft", action="store_true",
                   help="start a redis-server and the head with RAY_REDIS_ADDRESS (Ray's GCS "
                        "fault tolerance; see docs/clusters.md for what survives)")
    common(u)
    u.set_defaults(func=_run(cmd_up))
    a = csub.add_parser("add", help="start one more worker node (ray start --address)")
    a.add_argument("--cpus", type=int, default=2)
    common(a)
    a.set_defaults(func=_run(cmd_add))
    e = csub.add_parser("env", help="print the export lines a client needs")
    common(e)
    e.set_defaults(func=_run(cmd_env))
    s = csub.add_parser("status", help="the recorded nodes and whether they run")
    s.add_argument("--json", action="store_true")
    common(s)
    s.set_defaults(func=_run(cmd_status))
    d = csub.add_parser("down", help="stop exactly the recorded nodes")
    d.add_argument("--keep-temp", action="store_true", help="keep the nodes' temp dirs (logs)")
    common(d)
    d.set_defaults(func=_run(cmd_down))
