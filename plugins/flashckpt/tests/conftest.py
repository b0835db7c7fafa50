import os
import sys
import uuid

import pytest

from dlrover_core.testing import *  # noqa: F401,F403

# the suite's workloads (flash_workloads.py, not installed) are imported as
# ``plugins.flashckpt.tests.flash_workloads``, here and by the Ray workers (whose
# PYTHONPATH has the current directory: run the suite from the repository's root)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


@pytest.fixture
def job(ray_cluster):
    """A fresh flash checkpoint job name on the test cluster; afterwards the job is
    finished (its persisters stopped) and must have left no shared-memory buffer."""
    from dlrover_plugin_flashckpt import shm
    from dlrover_plugin_flashckpt.persister import finish_job

    name = f"flash-{uuid.uuid4().hex[:8]}"
    yield name
    # grace_s 3: a test's abandoned incarnation has no other node whose ranks could come
    finish_job(name, timeout=30, grace_s=3.0)
    assert not shm.list_segments("/dev/shm", shm.job_prefix(name))
