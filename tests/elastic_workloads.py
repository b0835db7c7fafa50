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
    """The global batch and micro-batch come from the spec's ``elastic`` section through
    the context (``self.context.global_batch``, ``micro_batch``, ``grad_accum_steps`` at
    this world size). Config: ``max_steps``, ``num_samples`` (default ``global_batch x
    max_steps``), ``batches_per_shard`` (default 1), ``sleep_s`` per step, ``fault``
    ``{rank, step}``: SIGKILL that rank at that step in attempt 0. Steps come from
    ``ShardSampler.next_step`` (the same number on every rank); each ids record holds the
    sampler's generation (a restore's) and the world size."""

    def setup(self) -> None:
        torch.set_num_threads(1)
        c, ctx = self.config, self.context
        self.max_steps = int(c.max_steps)
        self.plan = ElasticBatch(ctx.global_batch, ctx.micro_batch, self.world_size)
        assert self.plan.grad_accum_steps == ctx.grad_accum_steps
        self.model = self.backend.wrap(_model())
        self.opt = make_optimizer(self.model)
        self.extra = {"step": 0}
        self.x, self.y = _data(int(c.get("num_samples", ctx.global_batch * self.max_steps)))
        self.sampler = ShardSampler.for_workload(  # micro-batch, accumulation: the context's
            self, num_samples=len(self.x), batches_per_shard=int(c.get("batches_per_shard", 1)))
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
        step, done = self.start, self.start
        for step in range(self.start, self.max_steps):
            if fault and int(fault.rank) == self.rank and int(fault.step) == step \
                    and self.attempt == 0:
                self.sampler.flush()  # the master has every report the ids log has
                os.kill(os.getpid(), signal.SIGKILL)
            micro = self.sampler.next_step()  # every rank gets None at the same step
            if micro is None:
                break  # the data set is done
            batches = [(self.x[idx], self.y[idx]) for idx in micro]
            ids = [i for idx in micro for i in idx]
            loss = accumulation_step(self.model, self.opt, batches, _mse)
            self.sampler.step_done(step)
            with open(os.path.join(self.job_dir, f"ids-{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"attempt": self.attempt, "step": step, "ids": ids,
                                    "generation": self.sampler.generation,
                                    "world_size": self.world_size}) + "\n")
            self.report(step, loss=loss, world_size=float(self.world_size))
            self.extra["step"] = done = step + 1
            self.checkpointer.maybe_save(step + 1, model=self.model, optimizer=self.opt,
                                         extra=self.extra, shards=self.sampler)
            time.sleep(float(c.get("sleep_s", 0.0)))
        if self.rank == 0:
            open(os.path.join(self.job_dir, "trainer_done"), "w").close()
        return {"steps": done}


class Watcher(BaseWorkload):
    """Another role of the job: reports a step every 0.2 s until the trainer is done."""

    def run(self) -> int:
        step = 0
        while not os.path.exists(os.path.join(self.job_dir, "trainer_done")):
            self.report(step, alive=1.0)
            step += 1
            time.sleep(0.2)
        return step


def read_ids(job_dir: str) -> dict:
    """The per-rank sample-id logs of :class:`ElasticRegression` in ``job_dir``, sorted
    out by restore: ``start`` (shard-service generation -> its first step); ``final``
    (a ``Counter`` of the ids of the steps no later restore rolled back: the final
    model's history), ``reread`` (ids of the steps a later restore rolled back: done
    again), ``steps`` ((generation, rank) -> the steps of the final history)."""
    import collections

    records = []
    for name in sorted(os.listdir(job_dir)):
        if name.startswith("ids-") and name.endswith(".jsonl"):
            with open(os.path.join(job_dir, name)) as f:
                records += [dict(json.loads(line), rank=int(name[4:-6])) for line in f
                            if line.strip()]
    start: dict[int, int] = {}
    for r in records:
        start[r["generation"]] = min(start.get(r["generation"], r["step"]), r["step"])
    final: collections.Counter = collections.Counter()
    reread, steps = 0, collections.defaultdict(set)
    for r in records:
        if any(g > r["generation"] and s <= r["step"] for g, s in start.items()):
            reread += len(r["ids"])
        else:
            final.update(r["ids"])
            steps[(r["generation"], r["rank"])].add(r["step"])
    return {"start": start, "final": final, "reread": reread, "steps": dict(steps)}
