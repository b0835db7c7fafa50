"""The harness's command line: enumerate, run, print, end with the JSON line."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from crashtest.run import SAVERS, one_run, points_of

def target(case, point, reached: dict[str, dict[str, int]]) -> tuple[str | None, int]:
    """``(the process armed for point, its hits in the fault-free fault phase)``: the
    case's choice (the flash persister for its persist, commit and prune points), else
    the highest rank that reached it; ``(None, 0)`` when none did."""
    seen = reached.get(point.name, {})
    fixed = case.target(point)
    if fixed:
        return fixed, seen.get(fixed, 0)
    ranks = sorted(int(r[4:]) for r in seen if r.startswith("rank"))
    return (f"rank{ranks[-1]}", seen[f"rank{ranks[-1]}"]) if ranks else (None, 0)


def quick_points(points: list) -> list:
    """One point per area (the first by name), for the quick subset."""
    seen, out = set(), []
    for p in points:
        if p.area not in seen:
            seen.add(p.area)
            out.append(p)
    return out


def planned_runs(case, points: list, worlds: list[int], quick: bool,
                 reached: dict[int, dict[str, dict[str, int]]],
                 restart_reached: dict[int, dict[str, dict[str, int]]],
                 only: list[str] | None = None,
                 persister_worlds: list[int] | None = None) -> list[tuple]:
    """The faulted runs of ``case``'s saver: ``(point, fault, world, process, nth hit,
    variant)`` for each point (one per area when ``quick``) x fault x rank count x hit
    x variant; ``reached``/``restart_reached``: per rank count, the fault-free run's
    hits of its fault phase / its restart (point -> process -> count);
    ``persister_worlds``: the rank counts at which the points a case faults in its
    persister (the flash saver's) are faulted (default: every one of ``worlds``); at the
    largest of them, each hit that a left-out rank count would have faulted (the flash
    saver's last hit, after the rollback, at 4 ranks) is faulted with SIGKILL too."""
    todo = quick_points(points) if quick else points
    todo = [p for p in todo if not only or any(o in p.name for o in only)]
    jobs = []
    for p in todo:
        for fault in p.faults:
            if quick and fault not in case.QUICK_FAULTS:
                continue
            for world in worlds:
                if quick and world not in case.QUICK_WORLDS:
                    continue
                if persister_worlds is not None and case.target(p) == "persister" \
                        and world not in persister_worlds:
                    continue
                who, count = target(case, p, reached.get(world, {}))
                variants = case.variants(p, fault, world, quick)
                if count == 0 and p.area == "load":  # reached only by the restart's load
                    who, count = target(case, p, restart_reached.get(world, {}))
                    variants = [{**case.TRACE_VARIANT, "arm_restart": True}]
                nths = set(case.nths(count, world, quick))
                if who == "persister" and fault == "sigkill" and persister_worlds \
                        and world == max(persister_worlds):
                    nths |= {n for w in worlds if w not in persister_worlds
                             for n in case.nths(count, w, quick)}
                for nth in sorted(nths):
                    for variant in variants:
                        jobs.append((p, fault, world, who, nth, variant))
    return jobs


def run_saver(name: str, worlds: list[int], quick: bool, base: str, emit,
              parallel: int = 1, only: list[str] | None = None,
              persister_worlds: list[int] | None = None) -> dict:
    """Every run of saver ``name`` (``parallel`` at a time); ``emit(line)`` prints a
    violation as it is found; ``only``: faults only the points whose name contains one
    of these (every point is still traced); ``persister_worlds``: see
    :func:`planned_runs`. Returns ``{"points", "runs", "faults", "violations"}``."""
    case = importlib.import_module(f"crashtest.{name}_case")
    points = points_of(case)
    violations: list[str] = []
    runs, faults = 0, set()
    reached: dict[int, dict[str, dict[str, int]]] = {}
    ever: set[str] = set()
    restart_reached: dict[int, dict[str, dict[str, int]]] = {}
    for world in worlds:
        if quick and world not in case.QUICK_WORLDS:
            continue
        r = one_run(case, base, world, variant=case.TRACE_VARIANT)
        runs += 1
        reached[world] = r["hits"]
        restart_reached[world] = r["restart_hits"]
        ever |= set(r["hits"]) | set(r["restart_hits"])
        for v in r["violations"]:
            emit(f"baseline {v}")
            violations.append(v)
    for p in points if not quick else []:  # the quick subset runs a part of the ranks
        if p.name not in ever:
            v = f"{name}: point {p.name} never reached in a fault-free run (tested vacuously)"
            emit(v)
            violations.append(v)
    jobs = planned_runs(case, points, worlds, quick, reached, restart_reached, only,
                        persister_worlds)
    faults |= {j[1] for j in jobs}
    with ThreadPoolExecutor(parallel) as pool:
        for r in pool.map(lambda j: one_run(case, base, j[2], j[0], j[1], j[3], j[4], j[5]),
                          jobs):
            runs += 1
            for v in r["violations"]:
                emit(v)
                violations.append(v)
    return {"points": len(points), "runs": runs, "faults": faults, "violations": violations}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--savers", default=",".join(SAVERS))
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--quick", action="store_true", help="one point per area, two faults")
    ap.add_argument("--self-test", action="store_true",
                    help="feed the invariants wrong outcomes; fail unless each is caught")
    ap.add_argument("--jobs", type=int, default=4, help="runs at a time (default 4)")
    ap.add_argument("--points", default="",
                    help="fault only points whose name contains one of these (comma list)")
    ap.add_argument("--persister-ranks", default="",
                    help="the rank counts at which the points of a saver's persister (the "
                         "flash saver's persist and commit points) are faulted (comma list; "
                         "default: those of --ranks)")
    ap.add_argument("--dir", default=None, help="where runs go (default: a temp dir)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.self_test:
        from crashtest.selftest import self_test

        caught = self_test()
        print(json.dumps(caught))
        return 0 if caught["missed"] == 0 else 1
    base = args.dir or tempfile.mkdtemp(prefix="crash-test-")
    savers = [s for s in args.savers.split(",") if s]
    worlds = [int(w) for w in args.ranks.split(",")]

    def emit(line: str) -> None:
        print(f"VIOLATION {line}", flush=True)

    total = {"points": 0, "runs": 0, "faults": set(), "violations": []}
    for name in savers:
        out = run_saver(name, worlds, args.quick, base, emit, args.jobs,
                        [p for p in args.points.split(",") if p],
                        [int(w) for w in args.persister_ranks.split(",") if w] or None)
        print(f"# {name}: {out['points']} points, {out['runs']} runs, "
              f"{len(out['violations'])} violations, {time.monotonic() - t0:.0f} s", flush=True)
        for k in ("points", "runs", "violations"):
            total[k] += out[k]
        total["faults"] |= out["faults"]
    try:  # Ray's forwarded worker lines (raylet notices) must not follow the JSON line
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except ImportError:
        pass
    sys.stdout.flush()
    print(json.dumps({"points": total["points"], "faults": sorted(total["faults"]),
                      "runs": total["runs"], "violations": len(total["violations"]),
                      "savers": savers, "seconds": round(time.monotonic() - t0, 1)}))
    return 1 if total["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
