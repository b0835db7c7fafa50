"""What the job sees of a persister that cannot persist: the real persister actor on a
local Ray cluster, its checkpoint folder on a real full tmpfs."""

from __future__ import annotations

import errno
import os
import time

import torch
from test_flash_commit import small_tmpfs  # noqa: F401 - a fixture

from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
from dlrover_plugin_flashckpt.handles import persist_failures
from dlrover_plugin_flashckpt.saver import FlashSaver


def test_a_full_target_is_reported_by_the_jobs_persisters_until_space_returns(
        job, small_tmpfs):  # noqa: F811
    d = os.path.join(small_tmpfs, "ckpt")
    filler = os.path.join(small_tmpfs, "filler")
    with open(filler, "wb") as f:
        st = os.statvfs(small_tmpfs)
        f.write(b"\0" * (st.f_bavail * st.f_frsize - (64 << 10)))
    s = FlashSaver(SaverConfig(dir=d, keep=2, job=job, options={"wait_timeout_s": 60}),
                   SaverContext())
    s.save(1, {"w": torch.arange(50_000, dtype=torch.float32)})  # 200 KB: does not fit
    deadline = time.monotonic() + 60
    while not (failing := persist_failures(job)):
        assert time.monotonic() < deadline, "no persister reported the failure"
        time.sleep(0.2)
    [state] = failing.values()
    assert "step 1" in state["what"] and os.strerror(errno.ENOSPC) in state["error"]
    assert state["since"] <= time.time() and state["tries"] >= 1
    os.unlink(filler)
    s.wait()  # the backoff's next try lands the commit
    assert s.committed_steps() == [1]
    assert persist_failures(job) == {}
    assert ray_status(s)["recovered"]["tries"] >= 1
    s.close()


def ray_status(saver: FlashSaver) -> dict:
    import ray

    return ray.get(saver.persister().status.remote())
