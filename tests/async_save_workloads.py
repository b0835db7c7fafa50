"""A workload for tests/test_checkpoint_disk_async.py: saves one step with the job's
saver and returns at once (imported by the Ray workers)."""

from __future__ import annotations

import torch

from dlrover_core import BaseWorkload


class SaveAndReturn(BaseWorkload):
    """Saves step 3 (a ``Linear(4, 2)`` of ``config.seed``) and returns: with
    ``async_save`` the save is still being written when ``run()`` returns.
    ``config.unpicklable``: the step holds a lambda, so its write fails."""

    def run(self) -> dict:
        torch.manual_seed(int(self.config.get("seed", 0)))
        extra: dict = {"step": 3}
        if self.config.get("unpicklable"):
            extra["fn"] = lambda: 0
        self.checkpointer.save(3, model=torch.nn.Linear(4, 2), extra=extra)
        return {"saved": 3}
