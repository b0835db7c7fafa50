"""The elastic tests' workload: the model and data of ``tests/elastic_math.py`` under the
``ddp`` backend, batches from the master's shard service, the global batch kept by
gradient accumulation at any world size, checkpoints (with the shard state) through the
job's saver; each rank logs the sample ids of every step it trained to
``<job_dir>/ids-<rank>.jsonl``."""

from __future__ import annotations

import json
import os
import signal
import time

import torch

from dlrover_core import BaseWorkload
from dlrover_core.runtime.elastic import ElasticBatch, accumulation_step
from dlrover_core.runtime.sharding import ShardSampler
from tests.elastic_math import _data, _model, make_optimizer


def _mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


class ElasticRegression(BaseWorkload):
    """Config: ``global_batch``, ``micro_batch``, ``max_steps``, ``batches_per_shard``
    (1: each optimizer step reads whole shards, so the ranks read the same samples per
    step at any world size), ``sleep_s`` per step, ``fault`` ``{rank, step}``: SIGKILL
    that rank at that step in attempt 0."""

    def setup(self) -> None:
        torch.set_num_threads(1)
        c = self.config
        self.max_steps = int(c.max_steps)
        self.plan = ElasticBatch(int(c.global_batch), int(c.micro_batch), self.world_size)
        self.model = self.backend.wrap(_model())
        self.opt = make_optimizer(self.model)
        self.extra = {"step": 0}
        self.x, self.y = _data(int(c.global_batch) * self.max_steps)
        self.sampler = ShardSampler.for_workload(
            self, batch_size=int(c.micro_batch), num_samples=len(self.x),
            batches_per_shard=int(c.get("batches_per_shard", 1)))
        # the shard state is saved with the model: a restore rewinds the shard service
        loaded = self.checkpointer.load(model=self.model, optimizer=self.opt, extra=self.extra,
                                        shards=self.sampler)
        self.start = int(self.extra["step"]) if loaded is not None else 0
        if self.rank == 0:  # where each start restored from, for the tests
            source = getattr(self.checkpointer.saver, "last_load_source", None)
            with open(os.path.join(self.job_dir, "loads.jsonl"), "a") as f:
                f.write(json.dumps({"world_size": self.world_size, "loaded": loaded,
                                    "source": source}) + "\n")
        self.sampler.restore(self.start - 1)  # the checkpoint holds steps 0..start-1

    def run(self) -> dict:
        c = self.config
        fault = c.get("fault")
        step = self.start
        for step in range(self.start, self.max_steps):
            if fault and int(fault.rank) == self.rank and int(fault.step) == step \
                    and self.attempt == 0:
                self.sampler.flush()  # the master has every report the ids log has
                os.kill(os.getpid(), signal.SIGKILL)
            batches, ids = [], []
            for _ in range(self.plan.grad_accum_steps):
                idx = self.sampler.next_indices()
                if idx is None:
                    break
                batches.append((self.x[idx], self.y[idx]))
                ids += idx
            if len(batches) < self.plan.grad_accum_steps:
                break  # the data set is done
            loss = accumulation_step(self.model, self.opt, batches, _mse)
            self.sampler.step_done(step)
            with open(os.path.join(self.job_dir, f"ids-{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"attempt": self.attempt, "step": step, "ids": ids}) + "\n")
            self.report(step, loss=loss, world_size=float(self.world_size))
            self.extra["step"] = step + 1
            self.checkpointer.maybe_save(step + 1, model=self.model, optimizer=self.opt,
                                         extra=self.extra, shards=self.sampler)
            time.sleep(float(c.get("sleep_s", 0.0)))
        if self.rank == 0:
            open(os.path.join(self.job_dir, "trainer_done"), "w").close()
        return {"steps": step + 1}


class Watcher(BaseWorkload):
    """Another role of the job: reports a step every 0.2 s until the trainer is done."""

    def run(self) -> int:
        step = 0
        while not os.path.exists(os.path.join(self.job_dir, "trainer_done")):
            self.report(step, alive=1.0)
            step += 1
            time.sleep(0.2)
        return step
