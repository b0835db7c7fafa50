"""The invariants checked after every run, from ground truth only (the journals, the
committed steps listed after the fault and after the restart, what each rank loaded).

A run is a dict: ``ops`` (the fault phase's), ``world``, ``keep``, ``durable_after``
(``save`` or ``wait``: after which operation a step must be committed), ``journals``
(per rank, the fault phase's records), ``fault`` (per rank, :func:`crashtest.launch.
run_phase`'s outcome), ``c1`` / ``c2`` (committed steps after the fault / after the
restart), ``memory`` (steps READY in memory on every rank in the current attempt
before the restart, flash; ``[]`` otherwise), ``restart`` (per rank, the restart's
outcome), ``fired`` (the armed point was hit), ``reports`` (errors the saver's other
processes reported, e.g. the persister's status), ``wedged`` (leftovers found).
:func:`check` returns one line per violation (``[]`` when all hold)."""

from __future__ import annotations

import re

from crashtest.journal import expected_digest as journal_digest
from crashtest.plan import NEW_STEP, lineage


def _ended(journal: list[dict], i: int) -> bool:
    return any(r["i"] == i and r["at"] == "end" for r in journal)


def lineages(run: dict) -> list[list[int]]:
    """The current lineage, and the other one when the last rollback began but
    returned on no rank (either may be current)."""
    journals = run["journals"]
    begun = max((r["i"] + 1 for j in journals for r in j if r["at"] == "begin"), default=0)
    loads = {i for i, op in enumerate(run["ops"]) if op[0] == "load" and op[1] is not None
             and any(_ended(j, i) for j in journals)}
    settled = {i for i, op in enumerate(run["ops"]) if op[0] == "save"
               and len(journals) == run["world"] and all(_ended(j, i) for j in journals)}
    cur, other = lineage(run["ops"], begun, loads, settled)
    return [cur] + ([other] if other is not None else [])


def durable(run: dict) -> set[int]:
    """Steps the saver promised committed: saves that returned on every rank
    (``durable_after`` ``save``), or the newest save before a wait that returned on
    every rank (``wait``: an older save may be superseded in memory, never persisted)."""
    journals, ops = run["journals"], run["ops"]
    if len(journals) < run["world"]:
        return set()
    out: set[int] = set()
    pending: int | None = None  # a wait promises the newest save before it
    for i, op in enumerate(ops):
        every = all(_ended(j, i) for j in journals)
        if op[0] == "save" and every:
            if run["durable_after"] == "save":
                out.add(op[1])
            pending = op[1]
        elif op[0] == "save":
            pending = None
        elif op[0] == "wait" and every and pending is not None:
            out.add(pending)
            pending = None
    return out


def acceptable(run: dict) -> set:
    """Steps the restart may resume: per lineage the newest committed step in it (from
    the listing after the fault, or after the restart less its new step: a commit that
    landed meanwhile), or a newer step READY in memory on every rank."""
    later = set(run["c2"]) - {NEW_STEP}
    ok: set = set()
    for lin in lineages(run):
        for committed in (set(run["c1"]), set(run["c1"]) | later):
            base = max(committed & set(lin), default=None)
            ok.add(base)
            ok |= {m for m in run["memory"] if m in lin and (base is None or m > base)}
    return ok


def _first_load(outcome: dict) -> dict | None:
    return next((r for r in outcome["results"] if r["op"] == "load"), None)


def check(run: dict) -> list[str]:
    """Every violated invariant, one line each (see the module docstring)."""
    v: list[str] = []
    expected_digest = run.get("digest_for") or journal_digest
    ok = acceptable(run)
    loads = [_first_load(o) for o in run["restart"]]
    steps = {ld["step"] for ld in loads if ld and ld["ok"]}
    for o, ld in zip(run["restart"], loads):
        if ld is None or not ld["ok"]:
            why = ld["error"] if ld else ("hung" if o["hung"] else f"exit {o['exitcode']}")
            v.append(f"resume: rank {o['rank']} restart load failed ({why}); acceptable "
                     f"{sorted(ok, key=str)}")
            continue
        if ld["step"] not in ok:
            v.append(f"resume: rank {o['rank']} resumed step {ld['step']} "
                     f"(from {ld.get('source')}); acceptable {sorted(ok, key=str)} "
                     f"(committed after fault {run['c1']}, lineages {lineages(run)})")
        elif ld["step"] is not None and ld["digest"] != expected_digest(o["rank"], ld["step"]):
            v.append(f"state: rank {o['rank']} loaded step {ld['step']} (from "
                     f"{ld.get('source')}) whose state differs from the saved one")
    acked = max((r["acked"] for j in run["journals"] for r in j if r.get("acked")), default=None)
    if acked is not None and any(s is None or s < acked for s in steps):
        v.append(f"offsets: step {acked}'s offsets were committed on the source, but the "
                 f"restart resumed {sorted(steps, key=str)}: the records in between are lost")
    for o in run.get("armed", []):  # a load that faulted may raise, never return wrong
        ld = _first_load(o)
        if ld and ld["ok"] and (ld["step"] not in ok or (ld["step"] is not None and ld[
                "digest"] != expected_digest(o["rank"], ld["step"]))):
            v.append(f"resume: rank {o['rank']} load under the fault returned step "
                     f"{ld['step']} (from {ld.get('source')}) not bit for bit the newest "
                     f"of its lineage; acceptable {sorted(ok, key=str)}")
    if len(steps) > 1:
        v.append(f"resume: ranks resumed different steps {sorted(steps, key=str)}")
    keep, c2 = run["keep"], set(run["c2"])
    # a step must survive only when every lineage that may be current holds it (after a
    # rollback whose first save did not settle, the abandoned history may be gone)
    in_lineage = set.intersection(*map(set, lineages(run)))
    # a step is pruned by keep when keep newer steps were committed at some moment: those
    # of an abandoned history count too (saves 10, 20, 30 with keep 2 prune 10 for good,
    # even after a rollback to 20 sets 30 aside)
    ever = durable(run) | set(run["c1"]) | c2
    for s in sorted((durable(run) | set(run["c1"])) & in_lineage):
        if s not in c2 and len([c for c in ever if c > s]) < keep:
            v.append(f"lost: step {s} (committed or promised) is gone after the restart "
                     f"though fewer than keep={keep} newer steps are committed ({sorted(c2)})")
    for s in sorted(durable(run) & in_lineage):
        if s not in run["c1"] and len([c for c in ever if c > s]) < keep:
            v.append(f"lost: step {s} returned as committed ({run['durable_after']}) but is "
                     f"not committed after the fault ({run['c1']})")
    for o in run["restart"]:
        bad = [r for r in o["results"] if not r["ok"]]
        if o["hung"] or bad or not o.get("done"):
            v.append(f"wedged: rank {o['rank']} restart did not save and commit step "
                     f"{NEW_STEP}: " + (bad[0]["error"] if bad else
                                        "hung" if o["hung"] else f"exit {o['exitcode']}"))
    if NEW_STEP not in c2 and all(o.get("done") for o in run["restart"]):
        v.append(f"wedged: step {NEW_STEP} saved after the restart is not committed ({sorted(c2)})")
    v += [f"wedged: {w}" for w in run["wedged"]]
    v += _silent_loss(run)
    return merge_ranks(v)


def merge_ranks(lines: list[str]) -> list[str]:
    """One line for the ranks that violated the same way: ``x: rank 0 y`` and ``x: rank
    1 y`` become ``x: ranks [0, 1] y``."""
    groups: dict[tuple[str, str], list[int]] = {}
    out: list = []
    for line in lines:
        m = re.match(r"^(\w+): rank (\d+) (.*)$", line, re.S)
        if m is None:
            out.append(line)
            continue
        key = (m.group(1), m.group(3))
        if key not in groups:
            groups[key] = []
            out.append(key)
        groups[key].append(int(m.group(2)))
    return [x if isinstance(x, str) else
            f"{x[0]}: rank{'s' if len(groups[x]) > 1 else ''} "
            f"{groups[x] if len(groups[x]) > 1 else groups[x][0]} {x[1]}" for x in out]


def _silent_loss(run: dict) -> list[str]:
    """A fired fault that cost the newest saved step must have been reported."""
    if not run["fired"]:
        return []
    fault = run["fault"] + run.get("armed", [])
    reported = (any(o["killed"] or o["hung"] or not o.get("done") for o in fault)
                or any(not r["ok"] for o in fault for r in o["results"])
                or any(o.get("warnings") for o in fault + run["restart"])
                or bool(run["reports"]))
    if reported:
        return []
    newest = lineages(run)[0][-1:] or [None]
    loads = [_first_load(o) for o in run["restart"]]
    resumed = {ld["step"] for ld in loads if ld and ld["ok"]}
    if newest[0] is not None and resumed != {newest[0]}:
        return [f"silent: the fault cost step {newest[0]} (resumed {sorted(resumed, key=str)}) "
                "and no operation raised, no warning was logged, no status named it"]
    return []
