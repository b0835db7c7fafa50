"""The operations of a run, the same on every rank (for every saver whose case does
not set its own ``FAULT_OPS``: the flash and ODL cases do).

The fault phase saves 10, 20, 30 (``keep`` = 2 prunes 10), waits, rolls back with
``load(step=20)``, saves 25 and 35 on that new lineage (pruning by number) and waits;
the restart loads, saves :data:`NEW_STEP` and waits (a wedged slot or lock shows as
that save or wait failing or overrunning :data:`RESTART_TIMEOUT_S`)."""

from __future__ import annotations

#: committed steps each saver keeps
KEEP = 2

FAULT_OPS: list[tuple] = [("load", None), ("save", 10), ("save", 20), ("save", 30), ("wait",),
                          ("load", 20), ("save", 25), ("save", 35), ("wait",), ("close",)]

#: the step the restart saves: newer than every step of the fault phase
NEW_STEP = 90

RESTART_OPS: list[tuple] = [("load", None), ("save", NEW_STEP), ("wait",), ("close",)]

#: seconds a phase may take before its processes count as hung (and are killed)
PHASE_TIMEOUT_S = 60.0
#: seconds the restart's save + wait of a new step may take (a wedged slot or lock)
RESTART_TIMEOUT_S = 45.0


def lineage(ops: list[tuple], begun: int, returned_loads: set[int],
            settled_saves: set[int] | frozenset = frozenset()
            ) -> tuple[list[int], list[int] | None]:
    """The steps of the current lineage after the first ``begun`` operations of ``ops``
    began somewhere: every save begun, cut back at each rollback ``load(step=N)`` (to
    the steps <= N of the lineage) that returned on some rank (``returned_loads``: the
    indices of those loads). A rollback takes effect on disk at the first save after
    it (a load alone changes nothing: a reader that never saves must not abandon a
    trainer's history); until a save after it returned on every rank
    (``settled_saves``: the indices of those saves), the history before it may still
    be current. Returns ``(lineage, other)``: ``other`` is the lineage had the last
    rollback that began but returned nowhere taken effect, or the history before a
    rollback that returned but no save after it settled (``None`` when neither)."""
    steps: list[int] = []
    other: list[int] | None = None
    unsettled = False  # ``other`` is the history before a returned rollback
    for i, op in enumerate(ops[:begun]):
        if op[0] == "save":
            steps.append(op[1])
            if other is not None and not unsettled:
                other.append(op[1])
            if unsettled and i in settled_saves:
                other, unsettled = None, False
        elif op[0] == "load" and op[1] is not None:
            cut = [s for s in steps if s <= op[1]]
            if i in returned_loads:
                steps, other, unsettled = cut, list(steps), True
            else:
                other, unsettled = cut, False
    return steps, other
