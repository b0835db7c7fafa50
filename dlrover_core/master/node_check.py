"""The pre-flight node check (DLRover's "node detection", seed ``003``), run by the
controller after every placement, before the ranks start.

On every node that holds a bundle of a role with a process group, a
:class:`~dlrover_core.runtime.node_probe.NodeProbe` runs in each of its GPU bundles (in
one of its bundles when none has a GPU; :func:`probe_bundles`) and measures

1. **compute**: a timed batched matmul (GFLOP/s) on every probe, all at once; a
   node's figure is its slowest device's;
2. **network, round 1**: the nodes (in a fixed order) in disjoint pairs, each pair a
   timed all-gather between the nodes' first probes, second probes, ... (every GPU
   of the pair's nodes, at once; the pair's bus bandwidth, GB/s, is the lowest of
   them); an odd node out waits for round 2;
3. **network, round 2**: every node of a pair that failed or was slow (below the
   round-1 median over ``slow_factor``) is paired again with a node of a good pair, so
   the bad one of a pair is found: a node that fails (or is slow) again is bad, its
   round-1 partner is cleared.

Verdicts (:func:`judge`): ``ok``; ``failed`` (the probe did not start, its matmul
failed or took longer than ``check_timeout_s``, its all-gather never returned, or it
failed both rounds); ``slow_compute`` (its slowest device's GFLOP/s below the median
of the other nodes' devices over ``slow_factor``); ``slow_network`` (slow in both rounds); ``unverified`` (its
pair failed and no good node was left to pair it with: kept). ``failed``,
``slow_compute`` and ``slow_network`` nodes are marked bad (the failover
coordinator's ``bad_nodes``, which the placement keeps out) and the job is placed
again without them; when that placement is impossible they are taken back
(``node_check_kept``) and the job runs where it can. So are they when a later placement
(a recovery's, after a node was lost) is impossible without them: :meth:`NodeCheck.place`.

The sizes (``node_health``: bfloat16 matmuls and all-gathers of tens of MiB on a GPU,
small float32 ones on a CPU) and the clocks (CUDA events on a GPU) are the probe's:
:mod:`dlrover_core.runtime.node_probe`.

Everything goes to one ``node_check`` event per check; ``dlrover diagnose`` prints it.
A cluster of one alive node is not checked (``node_check_skipped``): with no peer no
node can be slow, and a failed node would be taken back, as the job has nowhere else.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dlrover_core.master.launcher import kill_actor
from dlrover_core.master.monitor import alive_nodes
from dlrover_core.master.node_verdict import (  # noqa: F401 - re-exported (tests)
    BAD_VERDICTS, NodeResult, _slow, judge, probe_bundles, round1_pairs, round2_batches)
from dlrover_core.placement import PlacementError
from dlrover_core.runtime.context import MASTER_NAMESPACE
from dlrover_core.runtime.node_probe import probe_sizes, remote_node_probe

if TYPE_CHECKING:
    from dlrover_core.master.launcher import Launcher
    from dlrover_core.master.scope import JobScope

#: s a probe may take to start (process start and ``import torch``)
PROBE_START_S = 60.0
#: checks (and placements) in a row before the job runs on what it has
MAX_ROUNDS_OF_PLACEMENT = 3
#: JobContext key of :attr:`NodeCheck.excluded`
EXCLUDED_KEY = "node_check_excluded"
#: why a cluster of one alive node is not checked (``node_check_skipped``)
LONE_NODE = ("the cluster has one alive node: no peer to compare it with and nowhere "
             "else to place the job")


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
    def placement_nodes(self) -> dict[str, list[tuple[Any, int, dict]]]:
        """node id -> the (placement group, bundle index, resources) to probe there:
        :func:`probe_bundles` of the bundles of the roles with a process group."""
        plan, pgs = self.launcher.plan, self.launcher.pgs
        bundles: list[tuple[str, Any, int, dict]] = []
        tables: dict[int, dict] = {}
        for (role, _rank), slot in sorted(plan.slots.items()):
            if not self.scope.graph.roles[role].backend:
                continue
            if slot.pg not in tables:
                tables[slot.pg] = ray.util.placement_group_table(pgs[slot.pg])
            node = tables[slot.pg].get("bundles_to_node_id", {}).get(slot.bundle)
            if node:
                bundles.append((node, pgs[slot.pg], slot.bundle, dict(slot.resources)))
        return probe_bundles(bundles)

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
    def check(self, nodes: dict[str, list[tuple[Any, int, dict]]]) -> dict[str, NodeResult]:
        """Probe ``nodes`` (from :meth:`placement_nodes`); emits ``node_check`` (with
        ``seconds``, the whole check's wall time, ``phases``: s of the probes' start,
        the matmul, round 1 and round 2, and ``settings``: the sizes) and returns node
        id -> result."""
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
            self._matmul(probes, results, timeout, nodes)
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
            for handles in probes.values():
                for h, _gpu in handles:
                    kill_actor(h)
        self.results.update(results)
        keys = ("slow_factor", "matmul_size", "matmul_batch", "matmul_iters", "allgather_kb",
                "allgather_iters", "warmup_iters", "gpu_matmul_size", "gpu_matmul_batch",
                "gpu_matmul_iters", "gpu_allgather_mb", "gpu_allgather_iters",
                "gpu_warmup_iters", "check_timeout_s")
        s.emit("node_check", nodes=[r.as_dict() for r in results.values()],
               excluded=sorted(n for n, r in results.items() if r.verdict in BAD_VERDICTS),
               seconds=round(time.time() - t0, 3), phases=phases,
               probes=sum(len(v) for v in probes.values()),
               settings={k: o[k] for k in keys})
        return results

    def _start_probes(self, nodes: dict,
                      results: dict[str, NodeResult]) -> dict[str, list[tuple[Any, bool]]]:
        """One probe per bundle to probe; node id -> ``[(handle, on_gpu)]``. A node one
        of whose probes does not answer within :data:`PROBE_START_S` fails."""
        s = self.scope
        handles: dict[tuple[str, int], Any] = {}
        for node, bundles in nodes.items():
            for i, (pg, bundle, res) in enumerate(bundles):
                handles[(node, i)] = remote_node_probe().options(
                    name=f"dlrover-{s.name}-nodecheck-{node[:12]}-{i}-{uuid.uuid4().hex[:6]}",
                    namespace=MASTER_NAMESPACE,
                    num_cpus=res.get("CPU", 0.0), num_gpus=res.get("GPU", 0.0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=bundle)).remote(
                            len(nodes) > 1)
        infos = self._gather({k: h.info.remote() for k, h in handles.items()}, PROBE_START_S)
        probes: dict[str, list[tuple[Any, bool]]] = {}
        for node in nodes:
            keys = sorted(k for k in handles if k[0] == node)
            failed = [infos[k][1] for k in keys if not infos[k][0]]
            if failed:
                results[node].verdict, results[node].reason = "failed", f"probe: {failed[0]}"
                for k in keys:
                    kill_actor(handles[k])
                continue
            results[node].ip = infos[keys[0]][1]["ip"]
            probes[node] = [(handles[k], infos[k][1]["device"] == "cuda") for k in keys]
        return probes

    def _matmul(self, probes: dict, results: dict[str, NodeResult], timeout: float,
                bundles: dict) -> None:
        o = self.options
        calls = {}
        for node, handles in probes.items():
            for i, (h, gpu) in enumerate(handles):
                calls[(node, i)] = h.matmul.remote(**probe_sizes(o, gpu)["matmul"])
        out = self._gather(calls, timeout)
        for node in list(probes):
            done = [(i, out[(node, i)]) for i in range(len(probes[node]))]
            bad = [res for _, (ok, res) in done if not ok]
            if bad:
                results[node].verdict, results[node].reason = "failed", f"matmul: {bad[0]}"
                for h, _gpu in probes.pop(node):
                    kill_actor(h)
                continue
            nodes = bundles.get(node, [])
            devices = []
            for i, (_ok, res) in done:
                bundle = nodes[i][1] if i < len(nodes) else i
                devices.append({"bundle": bundle, "device": res["device"],
                                "dtype": res["dtype"], "gflops": round(res["gflops"], 3),
                                "matmul_s": round(res["seconds"], 5)})
            worst = min(done, key=lambda d: d[1][1]["gflops"])[1][1]
            results[node].gflops, results[node].matmul_s = worst["gflops"], worst["seconds"]
            results[node].devices = devices

    def _run_pairs(self, pairs: list[tuple[str, str]], rnd: int, probes: dict,
                   results: dict[str, NodeResult], timeout: float) -> None:
        """Run the all-gathers of disjoint ``pairs`` at once, between the nodes' k-th
        probes for every k both have; record each pair's outcome (its lowest bandwidth)
        on both nodes. A probe that did not answer is dropped with its node."""
        o = self.options
        pairs = [(a, b) for a, b in pairs if a in probes and b in probes]
        if not pairs:
            return
        links = [(a, b, k) for a, b in pairs for k in range(min(len(probes[a]),
                                                                 len(probes[b])))]
        ports = self._gather({(a, b, k): probes[a][k][0].free_port.remote()
                              for a, b, k in links}, timeout)
        calls = {}
        for a, b, k in links:
            ok, port = ports[(a, b, k)]
            if not ok:
                continue
            gpu = probes[a][k][1] and probes[b][k][1]
            sizes = probe_sizes(o, gpu)
            for rank, node in enumerate((a, b)):
                calls[(a, b, k, rank)] = probes[node][k][0].allgather.remote(
                    results[a].ip, int(port), rank, sizes["allgather_kb"],
                    sizes["allgather_iters"], timeout, sizes["warmup"], gpu)
        # both ranks wait at most ``timeout`` for the rendezvous and each collective
        out = self._gather(calls, 2 * timeout + 5)
        for a, b in pairs:
            ks = [k for x, y, k in links if (x, y) == (a, b)]
            rs = [(out.get((a, b, k, 0), (False, "no port")), out.get((a, b, k, 1), (False, "")))
                  for k in ks]
            ok = bool(rs) and all(r0[0] and r1[0] for r0, r1 in rs)
            bw = min(min(r0[1]["busbw_gbps"], r1[1]["busbw_gbps"]) for r0, r1 in rs) \
                if ok else None
            err = "" if ok else "; ".join(str(r[1])[:200] for pair in rs for r in pair
                                         if not r[0] and r[1])
            for node, peer in ((a, b), (b, a)):
                results[node].pairs.append({"round": rnd, "peer": peer, "ok": ok,
                                            "busbw_gbps": None if bw is None else round(bw, 4),
                                            "links": len(ks), "error": err})
        for key, (ok, res) in out.items():
            if not ok and res == "no answer":  # stuck: it cannot take part any more
                node = key[0] if key[3] == 0 else key[1]
                results[node].no_answer = (f"its all-gather (round {rnd}) did not return "
                                           f"within {2 * timeout + 5:g} s")
                for h, _gpu in probes.pop(node, []):
                    kill_actor(h)

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
