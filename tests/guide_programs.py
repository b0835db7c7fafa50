"""Seed 004's programs (DLRover's unified API guide), with only the import lines
changed (``dlrover.python.unified...`` -> ``dlrover_core``) and the guide's ``...``
placeholders filled with small bodies. Run by tests/test_guide_api.py."""

import ray
from dlrover_core import BaseWorkload
from dlrover_core import BaseTrainer
from dlrover_core import trainer_invocation


def filter_func(input: int):
    if input < -1:
        return 0
    return input


# Step 1: Implement the Workload ------------------------------------------------
@ray.remote
class UserActorModel(BaseWorkload):

    def __init__(self, master_handle, config):
        super().__init__(master_handle, config)

        # define your actor property
        self.initialized = False
        self.updates = 0

    def init_model(self):
        # preparation before training
        self.initialized = True
        return {"role": self.role, "rank": self.rank, "world_size": self.word_size,
                "local_rank": self.local_rank, "local_world_size": self.local_world_size,
                "name": self.name, "is_actor": self.is_actor_role(),
                "collocation": self.get_device_collocation(),
                "master": self.master_handle is not None, "k1": self.config.k1}

    def update_actor(self):
        # policy updating
        assert self.initialized, "init_model() runs before update_actor()"
        self.updates += 1
        return self.updates

    # the guide's trainer_invocation examples ---------------------------------
    # e.g. The actor has a method `a`, which can be invoked completely
    #      asynchronously without waiting for the result:
    @trainer_invocation(blocking=False)
    def a(self, xxx):
        return xxx * 2

    # e.g. ... a method `b`, which requires using the `wait` non-blocking mode to
    #      wait for the result, with a timeout of 30 seconds:
    @trainer_invocation(is_async=True, timeout=30)
    def b(self, xxx):
        return xxx + 100

    # e.g. When using method `b`, it also requires a pre-filtering method:
    @trainer_invocation(is_async=True, timeout=30, pre_function=filter_func)
    def c(self, input: int):
        return input + 1

    @trainer_invocation(post_func=sum)
    def d(self, xxx):
        return xxx + self.rank


# Step 2: Implement the Trainer -------------------------------------------------
class UserTrainer(BaseTrainer):

    def __init__(self, actor_handles, actor_classes, config):
        super().__init__(actor_handles, actor_classes, config)

        # define your trainer property
        self.field0 = None
        self.field1 = None
        self.rg = None

    def init(self):
        # define process logic for training preparation
        # (the role is 'actor' in an RL job, 'trainer' for the SFT job-level workload)
        self.rg = getattr(self, f"RG_{self.get_role_groups()[0].upper()}")
        self.field0 = self.rg.init_model()
        self.field1 = {role: cls.__name__ for role, cls in self.actor_classes.items()}

    def fit(self):
        # define the main process logic for training
        out = {"init": self.field0, "classes": self.field1,
               "roles": self.get_role_groups(),
               "resource": self.get_workload_resource(self.rg.role)}
        out["update"] = self.rg.update_actor()
        out["handles"] = ray.get([h.update_actor.remote() for h in self.actor_handles[self.rg.role]])
        out["a"] = self.rg.a(5).get()            # blocking=False: a DRef
        out["b"] = self.rg.b(1)
        out["c_low"] = self.rg.c(-5)             # filtered to 0 first
        out["c_high"] = self.rg.c(7)
        out["d"] = self.rg.d(10)
        import json
        import os
        with open(os.path.join(self.job_dir, "guide_fit.json"), "w") as f:
            json.dump(out, f)
        self.report(0, updates=out["update"][0])
        return out
