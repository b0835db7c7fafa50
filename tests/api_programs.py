"""Guide-style programs (seed 004's constructors) for tests/test_dlrover_api.py: each
process reports the ``global_env`` variable it sees and the Ray node it runs on, and
the trainer hands a non-blocking call's result to ``ray.get`` / ``ray.wait``."""

import json
import os

import ray

from dlrover_core import BaseTrainer, BaseWorkload, trainer_invocation

ENV_KEY = "DLR_API_GLOBAL"


@ray.remote
class ProbeWorkload(BaseWorkload):

    def __init__(self, master_handle, config):
        super().__init__(master_handle, config)

    def probe(self):
        return {"rank": self.rank, "env": os.environ.get(ENV_KEY), "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}

    @trainer_invocation(blocking=False)
    def twice(self, x):
        return 2 * x + self.rank


class ProbeTrainer(BaseTrainer):

    def __init__(self, actor_handles, actor_classes, config):
        super().__init__(actor_handles, actor_classes, config)

    def init(self):
        self.rg = getattr(self, f"RG_{self.get_role_groups()[0].upper()}")

    def fit(self):
        dref = self.rg.twice(5)                        # non-blocking: a DRef
        ready, pending = ray.wait(dref, num_returns=len(dref), timeout=60)
        out = {"driver": {"env": os.environ.get(ENV_KEY), "pid": os.getpid()},
               "ranks": self.rg.probe(), "get": ray.get(dref),
               "wait": [len(ready), len(pending)], "is_list": isinstance(dref, list)}
        with open(os.path.join(self.job_dir, "probe.json"), "w") as f:
            json.dump(out, f)
        return out
