"""The verdicts of the pre-flight node check (:mod:`dlrover_core.master.node_check`):
each node's figures (:class:`NodeResult`), which bundles get a probe
(:func:`probe_bundles`), the pairs of the two all-gather rounds (:func:`round1_pairs`,
:func:`round2_batches`) and the verdict of every node (:func:`judge`). No Ray here."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

#: verdicts that exclude a node
BAD_VERDICTS = ("failed", "slow_compute", "slow_network")


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
    #: one ``{"bundle", "device", "dtype", "gflops", "matmul_s"}`` per probe of the node
    #: (``gflops``/``matmul_s`` above: the slowest device's)
    devices: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"node_id": self.node_id, "ip": self.ip,
                "gflops": None if self.gflops is None else round(self.gflops, 3),
                "matmul_s": None if self.matmul_s is None else round(self.matmul_s, 4),
                "devices": self.devices, "pairs": self.pairs, "verdict": self.verdict,
                "reason": self.reason}


def probe_bundles(bundles: list[tuple[str, Any, int, dict]]) -> dict[str, list[tuple]]:
    """node id -> the ``(placement group, bundle index, resources)`` to probe there,
    from ``(node id, placement group, bundle index, resources)`` of the bundles of
    roles with a process group, in placement order: every bundle with a GPU (each
    holds its own), else the node's first bundle (its CPUs are shared by its ranks)."""
    out: dict[str, list[tuple]] = {}
    for node, pg, bundle, res in bundles:
        have = out.setdefault(node, [])
        if any(h[0] is pg and h[1] == bundle for h in have):
            continue  # two ranks of one bundle
        if float(res.get("GPU", 0) or 0) > 0:
            if have and float(have[0][2].get("GPU", 0) or 0) <= 0:
                have.clear()  # a GPU bundle replaces a CPU one taken first
            have.append((pg, bundle, res))
        elif not have:
            have.append((pg, bundle, res))
    return out


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
    flops = {n: [d["gflops"] for d in r.devices if d.get("gflops") is not None]
             or [r.gflops] for n, r in results.items() if r.gflops is not None}
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
        others = [f for n, fs in flops.items() if n != r.node_id for f in fs]
        med_flops = statistics.median(others) if others else None
        if med_flops and r.gflops < med_flops / slow_factor:
            r.verdict = "slow_compute"
            r.reason = (f"{r.gflops:.2f} GFLOP/s < {med_flops:.2f} (median of the other "
                        f"nodes' devices) / slow_factor {slow_factor:g}")
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

def _slow(pair: dict, results: dict[str, NodeResult], slow_factor: float) -> bool:
    """Whether a round-1 pair was below the round-1 median over ``slow_factor``."""
    bws = {tuple(sorted((r.node_id, p["peer"]))): p["busbw_gbps"] for r in results.values()
           for p in r.pairs if p["round"] == 1 and p["ok"]}
    if len(bws) < 2 or not pair["ok"]:
        return False
    return pair["busbw_gbps"] < statistics.median(bws.values()) / slow_factor
