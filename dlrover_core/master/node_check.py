"""The pre-flight node check (DLRover's "node detection", seed ``003``), run by the
controller after every placement, before the ranks start.

On every node that holds a bundle of a role with a process group, a
:class:`~dlrover_core.runtime.node_probe.NodeProbe` runs in that bundle and measures

1. **compute**: a timed matmul (GFLOP/s), all nodes at once;
2. **network, round 1**: the nodes (in a fixed order) in disjoint pairs, each pair a
   timed all-gather (bus bandwidth, GB/s); an odd node out waits for round 2;
3. **network, round 2**: every node of a pair that failed or was slow (below the
   round-1 median over ``slow_factor``) is paired again with a node of a good pair, so
   the bad one of a pair is found: a node that fails (or is slow) again is bad, its
   round-1 partner is cleared.

Verdicts (:func:`judge`): ``ok``; ``failed`` (the probe did not start, its matmul
failed or took longer than ``check_timeout_s``, its all-gather never returned, or it
failed both rounds); ``slow_compute`` (GFLOP/s below the median of the other nodes
over ``slow_factor``); ``slow_network`` (slow in both rounds); ``unverified`` (its
pair failed and no good node was left to pair it with: kept). ``failed``,
``slow_compute`` and ``slow_network`` nodes are marked bad (the failover
coordinator's ``bad_nodes``, which the placement keeps out) and the job is placed
again without them; when that placement is impossible they are taken back
(``node_check_kept``) and the job runs where it can. So are they when a later placement
(a recovery's, after a node was lost) is impossible without them: :meth:`NodeCheck.place`.

Everything goes to one ``node_check`` event per check; ``dlrover diagnose`` prints it.
A cluster of one alive node is not checked (``node_check_skipped``): with no peer no
node can be slow, and a failed node would be taken back, as the job has nowhere else.
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dlrover_core.master.launcher import kill_actor
from dlrover_core.master.monitor import alive_nodes
from dlrover_core.placement import PlacementError
from dlrover_core.runtime.context import MASTER_NAMESPACE
from dlrover_core.runtime.node_probe import remote_node_probe

if TYPE_CHECKING:
    from dlrover_core.master.launcher import Launcher
    from dlrover_core.master.scope import JobScope

#: s a probe may take to start (process start and ``import torch``)
PROBE_START_S = 60.0
#: checks (and placements) in a row before the job runs on what it has
MAX_ROUNDS_OF_PLACEMENT = 3
#: verdicts that exclude a node
BAD_VERDICTS = ("failed", "slow_compute", "slow_network")
#: JobContext key of :attr:`NodeCheck.excluded`
EXCLUDED_KEY = "node_check_excluded"
#: why a cluster of one alive node is not checked (``node_check_skipped``)
LONE_NODE = ("the cluster has one alive node: no peer to compare it with and nowhere "
             "else to place the job")


@dataclass
class NodeResult:
    """What the check found on one node; ``pairs``: ``{"round", "peer", "ok",
    "busbw_gbps", "error"}`` per all-gather it took part in."""

    node_id: str
    ip: str = ""
    gflops: float | None = None
    matmul_s: float | None = None
    pairs: list[dict] = field(default_factory=list)
    verdict: str = "ok"
    reason: str = ""
    #: set when its probe stopped answering during an all-gather: ``failed``, whatever
    #: the pairs say
    no_answer: str = ""

    def as_dict(self) -> dict:
        return {"node_id": self.node_id, "ip": self.ip,
                "gflops": None if self.gflops is None else round(self.gflops, 3),
                "matmul_s": None if self.matmul_s is None else round(self.matmul_s, 4),
                "pairs": self.pairs, "verdict": self.verdict, "reason": self.reason}


def round1_pairs(nodes: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Disjoint pairs of consecutive nodes, and the node left over (odd count)."""
    pairs = [(nodes[i], nodes[i + 1]) for i in range(0, len(nodes) - 1, 2)]
    return pairs, nodes[len(pairs) * 2:]


def round2_batches(suspects: list[str], good: list[str]) -> list[list[tuple[str, str]]]:
    """Pair each suspect with a good node (good nodes reused round-robin); batches of
    disjoint pairs that can run at once. Empty when there is no good node."""
    if not good:
        return []
    per = len(good)
    batches = []
    for start in range(0, len(suspects), per):
        batches.append([(s, good[i]) for i, s in enumerate(suspects[start:start + per])])
    return batches


def judge(results: dict[str, NodeResult], slow_factor: float) -> None:
    """Set the verdict of every node from its matmul and pair results (module doc).

    A pair counts as slow when its bandwidth is below the median of the round-1 pairs
    that worked over ``slow_factor`` (only with two or more such pairs)."""
    flops = {n: r.gflops for n, r in results.items() if r.gflops is not None}
    r1 = {}
    for r in results.values():
        for p in r.pairs:
            if p["round"] == 1 and p["ok"]:
                r1[tuple(sorted((r.node_id, p["peer"])))] = p["busbw_gbps"]
    med_bw = statistics.median(r1.values()) if len(r1) >= 2 else None

    def bad_pair(p: dict) -> str:
        if not p["ok"]:
            return "failed"
        if med_bw is not None and p["busbw_gbps"] < med_bw / slow_factor:
            return "slow"
        return ""

    for r in results.values():
        if r.gflops is None:  # did not start or its matmul failed: judged already
            continue
        if r.no_answer:
            r.verdict, r.reason = "failed", r.no_answer
            continue
        r.verdict, r.reason = "ok", ""
        others = [f for n, f in flops.items() if n != r.node_id]
        med_flops = statistics.median(others) if others else None
        if med_flops and r.gflops < med_flops / slow_factor:
            r.verdict = "slow_compute"
            r.reason = (f"{r.gflops:.2f} GFLOP/s < {med_flops:.2f} (median of the other "
                        f"nodes) / slow_factor {slow_factor:g}")
            continue
        rounds = {1: [bad_pair(p) for p in r.pairs if p["round"] == 1],
                  2: [bad_pair(p) for p in r.pairs if p["round"] == 2]}
        if rounds[1] and not any(rounds[1]):
            continue  # a good pair in round 1 (a round-2 partner's failure is not its own)
        if rounds[2]:
            if any(rounds[2]):  # failed again with a good partner: this node is bad
                worst = "failed" if "failed" in rounds[2] else "slow"
                r.verdict = "failed" if worst == "failed" else "slow_network"
                r.reason = (f"all-gather {worst} in round 1 and again with a good node"
                            if rounds[1] else f"all-gather {worst} with a good node")
        elif len(results) > 1:
            r.verdict = "unverified"
            r.reason = ("its pair failed and no good node was left to pair it with"
                        if rounds[1] else "no pair could be formed")


class NodeCheck:
    """Runs the check after each placement (:meth:`after_placement`)."""

    def __init__(self, scope: JobScope, launcher: Launcher) -> None:
        self.scope = scope
        self.launcher = launcher
        #: node id -> the last result (for ``status``)
        self.results: dict[str, NodeResult] = {}
        #: the nodes a check marked bad and that are still out (:meth:`place`); kept in
        #: the JobContext beside ``failover`` (a restarted master reads both back)
        self.excluded: set[str] = set(scope.context.get(EXCLUDED_KEY) or [])

    @property
    def options(self) -> Any:
        return self.scope.spec.node_health

    def enabled(self) -> bool:
        """On unless ``node_health.skip_node_check``, for jobs with a role that has a
        process group (SPMD)."""
        return not bool(self.options.skip_node_check) and \
            any(r.backend for r in self.scope.graph.roles.values())

    # ------------------------------------------------------------------ placement
    def placement_nodes(self) -> dict[str, tuple[Any, int, dict]]:
        """node id -> (placement group, bundle index, resources) of one bundle of a
        role with a process group on that node."""
        plan, pgs = self.launcher.plan, self.launcher.pgs
        out: dict[str, tuple[Any, int, dict]] = {}
        tables: dict[int, dict] = {}
        for (role, _rank), slot in sorted(plan.slots.items()):
            if not self.scope.graph.roles[role].backend:
                continue
            if slot.pg not in tables:
                tables[slot.pg] = ray.util.placement_group_table(pgs[slot.pg])
            node = tables[slot.pg].get("bundles_to_node_id", {}).get(slot.bundle)
            if node and node not in out:
                out[node] = (pgs[slot.pg], slot.bundle, dict(slot.resources))
        return out

    def after_placement(self) -> None:
        """Check the placement's nodes; exclude bad ones and place again (up to
        :data:`MAX_ROUNDS_OF_PLACEMENT` checks)."""
        if not self.enabled():
            return
        s = self.scope
        for _ in range(MAX_ROUNDS_OF_PLACEMENT):
            nodes = self.placement_nodes()
            if len(alive_nodes() | set(nodes)) == 1:  # a lone node: the check decides nothing
                s.emit("node_check_skipped", nodes=sorted(nodes), reason=LONE_NODE)
                return
            results = self.check(nodes)
            bad = sorted(n for n, r in results.items() if r.verdict in BAD_VERDICTS)
            if not bad:
                return
            self._exclude(bad)
            self.launcher.remove_placement()
            try:
                self.launcher.place()
            except PlacementError as exc:
                self._take_back(bad, exc)
                self.launcher.place()
                return

    def place(self) -> None:
        """``launcher.place()`` (every placement of the job goes through here): when the
        job no longer fits without the nodes an earlier check excluded (a node was lost
        since), the ones still alive are taken back (``node_check_kept``) and the job is
        placed again, as when a check's own exclusion leaves it no room.

        Raises:
            PlacementError: the job does not fit even with them (or none is alive).
        """
        try:
            self.launcher.place()
        except PlacementError as exc:
            back = sorted(self.excluded & self.scope.failover.bad_nodes & alive_nodes())
            if not back:
                raise
            self._take_back(back, exc)
            self.launcher.place()

    def _exclude(self, nodes: list[str]) -> None:
        s = self.scope
        s.failover.bad_nodes.update(nodes)
        self.excluded.update(nodes)
        s.context.set(EXCLUDED_KEY, sorted(self.excluded))
        s.context.set("failover", s.failover.snapshot())

    def _take_back(self, nodes: list[str], exc: PlacementError) -> None:
        s = self.scope
        s.failover.bad_nodes.difference_update(nodes)
        self.excluded.difference_update(nodes)
        s.context.set(EXCLUDED_KEY, sorted(self.excluded))
        s.context.set("failover", s.failover.snapshot())
        s.emit("node_check_kept", nodes=nodes,
               reason=f"the job cannot be placed without them: {exc}")

    # ------------------------------------------------------------------ the check
    def check(self, nodes: dict[str, tuple[Any, int, dict]]) -> dict[str, NodeResult]:
        """Probe ``nodes`` (from :meth:`placement_nodes`); emits ``node_check`` (with
        ``seconds``, the whole check's wall time, and ``phases``: s of the probes' start,
        the matmul, round 1 and round 2) and returns node id -> result."""
        s, o = self.scope, self.options
        t0 = time.time()
        timeout = float(o.check_timeout_s)
        results = {n: NodeResult(n) for n in nodes}
        phases: dict[str, float] = {}  # s of each part: start, matmul, round 1, round 2
        mark = [t0]

        def lap(name: str) -> None:
            now = time.time()
            phases[name], mark[0] = round(now - mark[0], 3), now

        probes = self._start_probes(nodes, results)
        lap("start_s")
        try:
            self._matmul(probes, results, timeout)
            lap("matmul_s")
            order = [n for n in sorted(nodes) if n in probes]
            pairs, odd = round1_pairs(order)
            self._run_pairs(pairs, 1, probes, results, timeout)
            lap("round1_s")
            judge(results, float(o.slow_factor))
            suspects = [n for n in order if n in probes and (
                n in odd or any(not p["ok"] or _slow(p, results, float(o.slow_factor))
                                for p in results[n].pairs))]
            good = [n for n in order if n in probes and n not in suspects]
            for batch in round2_batches(suspects, good):
                self._run_pairs(batch, 2, probes, results, timeout)
            lap("round2_s")
            judge(results, float(o.slow_factor))
        finally:
            for h in probes.values():
                kill_actor(h)
        self.results.update(results)
        s.emit("node_check", nodes=[r.as_dict() for r in results.values()],
               excluded=sorted(n for n, r in results.items() if r.verdict in BAD_VERDICTS),
               seconds=round(time.time() - t0, 3), phases=phases,
               settings={k: o[k] for k in ("slow_factor", "matmul_size", "matmul_iters",
                                           "allgather_kb", "allgather_iters",
                                           "check_timeout_s")})
        return results

    def _start_probes(self, nodes: dict, results: dict[str, NodeResult]) -> dict[str, Any]:
        """One probe per node in its bundle; nodes whose probe does not answer within
        :data:`PROBE_START_S` fail."""
        s = self.scope
        handles = {}
        for node, (pg, bundle, res) in nodes.items():
            handles[node] = remote_node_probe().options(
                name=f"dlrover-{s.name}-nodecheck-{node[:12]}-{uuid.uuid4().hex[:6]}",
                namespace=MASTER_NAMESPACE,
                num_cpus=res.get("CPU", 0.0), num_gpus=res.get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle)).remote(
                        len(nodes) > 1)
        infos = self._gather({n: h.info.remote() for n, h in handles.items()}, PROBE_START_S)
        probes = {}
        for node, (ok, info) in infos.items():
            if ok:
                results[node].ip = info["ip"]
                probes[node] = handles[node]
            else:
                results[node].verdict, results[node].reason = "failed", f"probe: {info}"
                kill_actor(handles[node])
        return probes

    def _matmul(self, probes: dict, results: dict[str, NodeResult], timeout: float) -> None:
        o = self.options
        out = self._gather({n: h.matmul.remote(int(o.matmul_size), int(o.matmul_iters))
                            for n, h in probes.items()}, timeout)
        for node, (ok, res) in out.items():
            if ok:
                results[node].gflops, results[node].matmul_s = res["gflops"], res["seconds"]
            else:
                results[node].verdict, results[node].reason = "failed", f"matmul: {res}"
                kill_actor(probes.pop(node))

    def _run_pairs(self, pairs: list[tuple[str, str]], rnd: int, probes: dict,
                   results: dict[str, NodeResult], timeout: float) -> None:
        """Run the all-gathers of disjoint ``pairs`` at once; record each pair's
        outcome on both nodes. A probe that did not answer is dropped."""
        o = self.options
        pairs = [(a, b) for a, b in pairs if a in probes and b in probes]
        if not pairs:
            return
        ports = self._gather({a: probes[a].free_port.remote() for a, _ in pairs}, timeout)
        calls = {}
        for a, b in pairs:
            ok, port = ports[a]
            if not ok:
                continue
            for rank, node in enumerate((a, b)):
                calls[(a, b, rank)] = probes[node].allgather.remote(
                    results[a].ip, int(port), rank, int(o.allgather_kb),
                    int(o.allgather_iters), timeout)
        # both ranks wait at most ``timeout`` for the rendezvous and each collective
        out = self._gather(calls, 2 * timeout + 5)
        for a, b in pairs:
            r0, r1 = out.get((a, b, 0), (False, "no port")), out.get((a, b, 1), (False, ""))
            ok = r0[0] and r1[0]
            bw = min(r0[1]["busbw_gbps"], r1[1]["busbw_gbps"]) if ok else None
            err = "" if ok else "; ".join(str(r[1])[:200] for r in (r0, r1) if not r[0])
            for node, peer in ((a, b), (b, a)):
                results[node].pairs.append({"round": rnd, "peer": peer, "ok": ok,
                                            "busbw_gbps": None if bw is None else round(bw, 4),
                                            "error": err})
        for key, (ok, res) in out.items():
            if not ok and res == "no answer":  # stuck: it cannot take part any more
                node = key[0] if key[2] == 0 else key[1]
                results[node].no_answer = (f"its all-gather (round {rnd}) did not return "
                                           f"within {2 * timeout + 5:g} s")
                if node in probes:
                    kill_actor(probes.pop(node))

    @staticmethod
    def _gather(refs: dict, timeout: float) -> dict:
        """key -> (ok, result or error text) for every ref, waiting at most ``timeout``
        s in all; a ref not ready by then is ``(False, "no answer")``."""
        if not refs:
            return {}
        by_ref = {r: k for k, r in refs.items()}
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=timeout)
        out = {k: (False, "no answer") for k in refs}
        for ref in ready:
            try:
                out[by_ref[ref]] = (True, ray.get(ref))
            except Exception as exc:  # noqa: BLE001 - the node's failure, recorded
                text = str(exc).strip().splitlines()
                out[by_ref[ref]] = (False, f"{type(exc).__name__}: "
                                           f"{text[-1][:300] if text else ''}")
        return out


def _slow(pair: dict, results: dict[str, NodeResult], slow_factor: float) -> bool:
    """Whether a round-1 pair was below the round-1 median over ``slow_factor``."""
    bws = {tuple(sorted((r.node_id, p["peer"]))): p["busbw_gbps"] for r in results.values()
           for p in r.pairs if p["round"] == 1 and p["ok"]}
    if len(bws) < 2 or not pair["ok"]:
        return False
    return pair["busbw_gbps"] < statistics.median(bws.values()) / slow_factor
