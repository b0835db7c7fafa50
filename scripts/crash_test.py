"""The crash-point harness (``make crash-test``): see ``scripts/crashtest/__init__.py``.

Usage: ``python scripts/crash_test.py [--savers disk,flash,odl] [--ranks 1,2,4]
[--persister-ranks 2,4] [--quick] [--self-test] [--dir DIR]``. Prints each violation,
ends with one JSON line (``points``, ``faults``, ``runs``, ``violations``, ``savers``,
``seconds``); exit status 1 on any violation."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from crashtest.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
