"""The harness's own test: every invariant must be able to fail. Wrong outcomes are fed
to :func:`crashtest.invariants.check` (a committed step removed, a wrong resume, a
changed state, a silent loss, a wedged restart) and to whole disk runs (a committed
step's file corrupted between the phases; a restart made to load an older step); each
must give violations, and the unchanged outcomes none."""

from __future__ import annotations

import copy
import tempfile

from crashtest.invariants import check
from crashtest.journal import expected_digest
from crashtest.plan import FAULT_OPS, KEEP, NEW_STEP


def clean_run() -> dict:
    """The outcomes of a fault-free disk run of one rank, as :func:`check` reads them."""
    journal = []
    for i, op in enumerate(FAULT_OPS):
        journal.append({"i": i, "op": op[0], "at": "begin"})
        journal.append({"i": i, "op": op[0], "at": "end"})
    load = {"op": "load", "ok": True, "step": 35, "digest": expected_digest(0, 35),
            "source": "disk"}
    return {"ops": FAULT_OPS, "world": 1, "keep": KEEP, "durable_after": "save",
            "journals": [journal], "c1": [30, 35], "c2": [35, NEW_STEP], "memory": [],
            "fault": [{"rank": 0, "results": [], "done": True, "warnings": [], "hung": False,
                       "killed": False, "exitcode": 0}],
            "restart": [{"rank": 0, "done": True, "hung": False, "exitcode": 0, "warnings": [],
                         "results": [load, {"op": "save", "ok": True},
                                     {"op": "wait", "ok": True}]}],
            "fired": True, "reports": [], "wedged": []}


def _mutations() -> dict:
    def lost(r):
        r["c2"] = [NEW_STEP]          # step 35 removed, not by keep

    def wrong_resume(r):
        ld = r["restart"][0]["results"][0]
        ld["step"], ld["digest"] = 30, expected_digest(0, 30)

    def changed_state(r):
        r["restart"][0]["results"][0]["digest"] = expected_digest(1, 35)

    def silent(r):                    # the last save never committed, nothing said
        r["c1"], r["c2"] = [25, 30], [25, 30, NEW_STEP]
        ld = r["restart"][0]["results"][0]
        ld["step"], ld["digest"] = 25, expected_digest(0, 25)
        r["durable_after"] = "wait"
        r["journals"][0] = [x for x in r["journals"][0] if not (x["i"] == 8 and x["at"] == "end")]

    def wedged(r):
        r["restart"][0]["results"][1] = {"op": "save", "ok": False, "error": "TimeoutError"}

    def not_committed(r):
        r["c2"] = [35]

    def acked_then_older(r):          # offsets of 35 acknowledged, the restart resumes 30
        r["journals"][0].append({"i": 7, "op": "save", "at": "end", "acked": 35})
        ld = r["restart"][0]["results"][0]
        ld["step"], ld["digest"] = 30, expected_digest(0, 30)

    return {"lost": (lost, "lost"), "wrong_resume": (wrong_resume, "resume"),
            "changed_state": (changed_state, "state"), "silent_loss": (silent, "silent"),
            "wedged_restart": (wedged, "wedged"), "new_step_missing": (not_committed, "wedged"),
            "offsets_acked_then_lost": (acked_then_older, "offsets")}


def self_test(real_runs: bool = True) -> dict:
    """Returns ``{"caught": [...], "missed": n, "clean_violations": [...]}``: each
    mutation caught (by a violation of its kind), and the violations of the unchanged
    outcomes (counted as missed: a check that fails on good outcomes proves nothing)."""
    caught, missed = [], []
    clean = check(clean_run())
    for name, (mutate, kind) in _mutations().items():
        run = copy.deepcopy(clean_run())
        mutate(run)
        (caught if any(v.startswith(kind) for v in check(run)) else missed).append(name)
    if real_runs:
        from crashtest import disk_case
        from crashtest.run import one_run

        base = tempfile.mkdtemp(prefix="crash-selftest-")
        if one_run(disk_case, base, 1)["violations"]:
            missed.append("real_clean_run")
        for name, variant in (("real_corrupt_step", {"corrupt": True}),
                              ("real_wrong_resume", {"wrong_resume": 30})):
            (caught if one_run(disk_case, base, 1, variant=variant)["violations"]
             else missed).append(name)
    return {"caught": caught, "missed": len(missed) + len(clean), "missed_names": missed,
            "clean_violations": clean}
