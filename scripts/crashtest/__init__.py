"""The crash-point harness (``make crash-test``, ``scripts/crash_test.py``).

For each saver (``disk``, ``flash``, ``odl``), each crash point of that saver declared
in :data:`dlrover_core.crashpoints.POINTS`, each fault that applies to the point and
1, 2 and 4 ranks in separate processes (``--persister-ranks``: fewer rank counts for
the points a case faults in its persister, SIGKILLed at the largest of them at the hits
the others would fault; CI passes ``2``), a run:

1. the **fault phase**: fresh rank processes run :data:`.plan.FAULT_OPS` (saves, a
   prune by ``keep``, a rollback ``load(step=N)`` and more saves; a case may have its
   own: the flash case waits once more, the ODL case has no rollback) with the point armed
   in the process that passes it (a rank; the flash persister for its persist, commit
   and prune points); every rank journals each operation it begins and each that
   returns (:mod:`.journal`, fsynced);
2. the **restart**: fresh processes, nothing armed, load, save a new step and wait;
3. the **invariants** (:mod:`.invariants`) on the journals, the committed steps read
   after the fault and after the restart, and what each rank loaded.

A fault-free run with a hit trace per saver and rank count proves that every point is
reached (a point never reached would be tested vacuously). ``--self-test`` feeds the
invariants wrong outcomes (a committed step removed, a wrong resume, a changed state,
a silent loss) and fails unless each is caught.

Modules: :mod:`.journal` (ground truth), :mod:`.ranks` (the rank process),
:mod:`.launch` (processes), :mod:`.plan` (operations), :mod:`.invariants`,
:mod:`.disk_case`, :mod:`.flash_case`, :mod:`.odl_case` (one per saver),
:mod:`.run` (enumeration, the JSON line), :mod:`.selftest`.
"""
