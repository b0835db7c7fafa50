"""The operations of a run, the same on every rank (and for every saver).

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


def lineage(ops: list[tuple], begun: int, returned_loads: set[int]) -> tuple[list[int],
                                                                            list[int] | None]:
    """The steps of the current lineage after the first ``begun`` operations of ``ops``
    began somewhere: every save begun, cut back at each rollback ``load(step=N)`` (to
    the steps <= N of the lineage) that returned on some rank (``returned_loads``: the
    indices of those loads). Returns ``(lineage, other)``: ``other`` is the lineage had
    the last rollback that began but returned nowhere taken effect (``None`` when
    none did)."""
    steps: list[int] = []
    other: list[int] | None = None
    for i, op in enumerate(ops[:begun]):
        if op[0] == "save":
            steps.append(op[1])
            if other is not None:
                other.append(op[1])
        elif op[0] == "load" and op[1] is not None:
            cut = [s for s in steps if s <= op[1]]
            if i in returned_loads:
                steps, other = cut, None
            else:
                other = cut
    return steps, other
