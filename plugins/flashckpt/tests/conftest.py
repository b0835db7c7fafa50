import uuid

import pytest

from dlrover_core.testing import *  # noqa: F401,F403


@pytest.fixture
def job(ray_cluster):
    """A fresh flash checkpoint job name on the test cluster; afterwards the job is
    finished (its persisters stopped) and must have left no shared-memory buffer."""
    from dlrover_plugin_flashckpt import shm
    from dlrover_plugin_flashckpt.persister import finish_job

    name = f"flash-{uuid.uuid4().hex[:8]}"
    yield name
    finish_job(name, timeout=30)
    assert not shm.list_segments("/dev/shm", shm.job_prefix(name))
