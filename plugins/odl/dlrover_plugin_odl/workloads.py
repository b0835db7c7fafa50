"""Workloads of the ``odl`` roles: what the driver (:mod:`dlrover_plugin_odl.driver`)
calls, and what you subclass.

==========  =============================================  ==============================
role        you provide                                    the driver calls
==========  =============================================  ==============================
source      nothing: :class:`SourceWorkload` reads the     ``seek``, ``read``, ``commit``,
            stream source ``config.odl.source.kind``        ``stats``
preprocess  ``transform_columns(columns) -> batch``        ``process``
            (default: the ``x`` and ``y`` columns as
            tensors), or row-wise ``transform(records)``
trainer     ``build_model()``; optionally                  ``resume_state``, ``train_step``,
            ``build_optimizer``, ``loss``, ``predict``      ``finish``
eval        ``build_model()``; optionally ``predict``       ``score``
==========  =============================================  ==============================

A *chunk* is what one source read returns: up to ``config.odl.batch_size *
config.odl.chunk_batches`` records of one partition, as columns from the source on
(:mod:`dlrover_plugin_odl.columns`); the trainer runs one optimizer step per
``batch_size`` of them. A batch is a dict of tensors with dim 0 = records (``x``:
float32 ``[N, features]``, ``y``: int64 ``[N]`` by default).

The trainer is prequential (test-then-train, Gama et al., 2013): each batch is
scored by the current model, in eval mode, before the model trains on it, in
train mode (:func:`prequential_step`); the counters, the baselines and the kappas
are :class:`~dlrover_plugin_odl.prequential.PrequentialStats`.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import numpy as np
import torch

from dlrover_core import BaseWorkload
from dlrover_core.crashpoints import crashpoint, declare
from dlrover_plugin_odl import ledger
from dlrover_plugin_odl.columns import to_records
from dlrover_plugin_odl.config import ODLConfig
from dlrover_plugin_odl.prequential import PrequentialStats
from dlrover_plugin_odl.source_workload import SourceWorkload
from dlrover_plugin_odl.steps import batch_slice, prequential_step

declare("odl.save.offsets", "state", "save",
        "the trainer saves a step with its stream offsets (before the saver's save)")
declare("odl.commit.offsets", "state", "commit",
        "a step is committed: its offsets are about to be handed to the driver to commit "
        "on the sources")
declare("odl.load.offsets", "state", "load",
        "a restarted trainer loaded a checkpoint, its stream offsets not yet restored")

__all__ = ["EvalWorkload", "OnlineTrainerWorkload", "PreprocessWorkload", "SourceWorkload",
           "batch_slice", "prequential_step", "unwrap"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (or the model itself)."""
    return getattr(model, "module", model)


# ---------------------------------------------------------------------------- preprocess
class PreprocessWorkload(BaseWorkload):
    """The ``preprocess`` role: turns a chunk's records into a batch. Stateless, so
    any instance can take any chunk and a restarted one loses nothing."""

    def failover_policy(self) -> str:
        """``roles.<role>.config.failover``: ``replace`` (the template's default; see
        :mod:`dlrover_plugin_odl.failover`) or ``rollback`` (the driver restarts); asked
        by the driver at start. Raises SpecError for another value."""
        from dlrover_core.graph.graph import check_failover_policy

        return check_failover_policy(self.role, (self.config or {}).get("failover"))

    def transform_columns(self, columns: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A chunk's columns (:func:`dlrover_plugin_odl.columns.to_columns`: field ->
        NumPy array of dim 0 = records, or a list) -> batch. Default: ``x`` (float32
        ``[N, F]``) from the ``x`` column and ``y`` (int64 ``[N]``) from ``y``, whole
        columns at once. Override this (or, row by row, :meth:`transform`).

        Raises:
            KeyError: the records have no ``x`` or ``y``.
        """
        x = torch.as_tensor(np.asarray(columns["x"], dtype=np.float32))
        y = torch.as_tensor(np.asarray(columns["y"], dtype=np.int64))
        return {"x": x, "y": y}

    def transform(self, records: list[dict]) -> dict[str, torch.Tensor]:
        """Row-wise records -> batch: used instead of :meth:`transform_columns` when a
        subclass overrides it (the records rebuilt from the columns,
        :func:`~dlrover_plugin_odl.columns.to_records`); the default is the same batch
        as :meth:`transform_columns`'s."""
        x = torch.tensor([r["x"] for r in records], dtype=torch.float32)
        y = torch.tensor([int(r["y"]) for r in records], dtype=torch.int64)
        return {"x": x, "y": y}

    def process(self, chunk: dict) -> dict:
        """``{"partition", "key", "positions", "n", "columns"}`` (what the source put)
        -> ``{"partition", "n", "ids", "batch"}`` (``ids``:
        :func:`dlrover_plugin_odl.ledger.record_id` of each record, ``str``)."""
        columns, n = chunk["columns"], int(chunk["n"])
        key = chunk.get("key", chunk["partition"])
        if type(self).transform is not PreprocessWorkload.transform:   # a row-wise override
            batch = self.transform(to_records(columns, n))
        else:
            batch = self.transform_columns(columns)
        return {"partition": chunk["partition"], "n": n,
                "ids": ledger.column_ids(columns.get("id"), key, chunk["positions"]),
                "batch": batch}


# ---------------------------------------------------------------------------- trainer
class OnlineTrainerWorkload(BaseWorkload):
    """The ``trainer`` role: prequential online training, checkpoints that hold the
    stream offsets, published model versions.

    Progress (``step``: steps trained, ``records``, ``offsets``: partition ->
    position of the last record trained, ``prequential``: the
    :class:`~dlrover_plugin_odl.prequential.PrequentialStats` counters) is saved in
    the same checkpoint as the model and optimizer (``extra["stream"]``, one atomic
    commit of the job's saver), every ``checkpoint.every_steps`` steps, so the
    counters survive a restart of the trainer (from the checkpoint) and of the
    driver (from the trainer's memory). ``config.lr`` (default 1e-3) and
    ``config.seed`` (default 0) are read by the defaults below.
    """

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.build_model() is not implemented")

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=float(self.config.get("lr", 1e-3)))

    def loss(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """Mean cross-entropy of ``model(batch["x"])`` (logits ``[N, C]``) vs ``batch["y"]``."""
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def predict(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        """Predicted labels ``[N]`` (argmax of the logits)."""
        return model(batch["x"]).argmax(dim=-1)

    # ------------------------------------------------------------------ lifecycle
    def setup(self) -> None:
        torch.manual_seed(int(self.config.get("seed", 0)))
        self.odl = ODLConfig.from_config(self.config)
        model = self.build_model()
        self.model = self.backend.wrap(model) if self.context.backend else model
        self.optimizer = self.build_optimizer(self.model)
        self.progress: dict[str, Any] = {"step": 0, "records": 0, "offsets": {},
                                         "prequential": PrequentialStats().state()}
        loaded = self._restore()
        self.stats = PrequentialStats.from_state(self.progress.get("prequential"))
        self.restored_step = loaded
        self._awaiting: dict[int, dict] = {}   # saved step -> offsets, until committed
        self._committed_step = loaded if loaded is not None else -1
        self._call_step = int(self.progress["step"])   # the last train_step's step
        # kept open while the workload lives; closed by finish()
        self._id_log = ledger.open_log(self.job_dir, ledger.TRAINED, self.rank) \
            if self.odl.log_record_ids else None
        if self._id_log is not None:  # what was trained after this step is thrown away
            ledger.write_restored(self._id_log, int(self.progress["step"]))
        self.published: int | None = None

    def resume_state(self) -> dict:
        """Progress of the model as it is in memory now: after a restart, that of
        the checkpoint it loaded. The driver resumes the stream after ``offsets``."""
        return {**self.progress, "restored_step": self.restored_step}

    def _state(self, extra: dict) -> dict[str, Any]:
        """The checkpoint's objects: the model, the optimizer (keyed by parameter names:
        a fresh one loads the saved moments), this rank's torch RNG, ``extra``."""
        from dlrover_core.runtime.role_state import OptimizerState, TorchRNG

        rank = self.rank if hasattr(self, "_context") else 0  # the crash harness's has none
        opt = OptimizerState.for_checkpointer(self.checkpointer, self.model, self.optimizer)
        return {"model": self.model, "optimizer": opt, f"rng_{rank}": TorchRNG(), "extra": extra}

    def _restore(self) -> int | None:
        """Load the newest checkpoint into the model, the optimizer, the RNG and
        :attr:`progress` (its stream offsets); returns its step or ``None``."""
        extra = {"stream": json.dumps(self.progress)}
        loaded = self.checkpointer.load(**self._state(extra))
        crashpoint("odl.load.offsets")
        if loaded is not None:
            self.progress = json.loads(extra["stream"])
        return loaded

    def _save(self, step: int) -> None:
        extra = {"stream": json.dumps(self.progress)}
        crashpoint("odl.save.offsets")
        self.checkpointer.save(step, **self._state(extra))
        self._awaiting[step] = dict(self.progress["offsets"])

    def _newly_committed(self) -> dict | None:
        """The newest saved step the saver has committed since the last call, with its
        offsets, or ``None``."""
        if not self._awaiting:
            return None
        done = [s for s in self.checkpointer.saver.committed_steps() if s in self._awaiting]
        if not done:
            return None
        step = max(done)
        crashpoint("odl.commit.offsets")
        offsets = self._awaiting[step]
        for s in [s for s in self._awaiting if s <= step]:
            del self._awaiting[s]
        self._committed_step = step
        return {"step": step, "offsets": offsets}

    def train_step(self, step: int, chunk: dict | None, offsets: dict, records: int,
                   steps: int = 1, shadow: dict | None = None, save: bool = False,
                   publish: bool = False) -> dict:
        """Run ``steps`` prequential optimizer steps on ``chunk``, batch ``i`` being its
        records ``[i * batch_size, (i + 1) * batch_size)``: each batch is scored with
        the current model, then trained on. A rank whose chunk has fewer batches than
        ``steps`` (or no chunk: then the driver passes another rank's as ``shadow``)
        runs the rest on its first batch (or ``shadow``'s) with the loss times 0, so
        it joins each step's DDP collectives with a zero gradient
        (:func:`prequential_step`).

        Before training, the state after ``step`` steps is checkpointed when a
        multiple of ``checkpoint.every_steps`` lies in ``(previous call's step,
        step]`` (with one step per call: when it divides ``step``), or when ``save``
        (the driver's clock: ``config.odl.checkpoint_every_s``). Afterwards the
        progress is ``step + steps`` with the stream ``offsets`` and ``records``
        (global totals) the driver passes; a model is published when a multiple of
        ``config.odl.publish_every`` lies in ``(step, step + steps]``, or when
        ``publish`` (``config.odl.publish_every_s``).

        Returns:
            ``{"n", "correct", "loss", "prequential", "committed"}``: records of
            this rank's chunk, prequentially correct ones in the whole call (rank 0;
            0 on the others), the mean loss of its batches, :meth:`PrequentialStats.
            metrics` after this call (rank 0; ``None`` on the others), and ``{"step",
            "offsets"}`` of a checkpoint committed since the last call (or ``None``).
        Raises:
            RuntimeError: the driver and the trainer disagree on the step.
            ValueError: ``steps`` is fewer than the chunk's batches.
        """
        if step != self.progress["step"]:
            raise RuntimeError(f"train_step({step}) but the trainer is at step "
                               f"{self.progress['step']}: driver and trainer are out of sync")
        n = int(chunk["n"]) if chunk else 0
        size = self.odl.batch_size
        own = -(-n // size)   # this rank's batches
        if own > steps:
            raise ValueError(f"train_step(steps={steps}) for a chunk of {n} records: "
                             f"{own} batches of config.odl.batch_size={size}")
        every = self.checkpointer.every_steps
        if step > 0 and ((every and step // every > self._call_step // every)
                         or (save and step not in self._awaiting
                             and step != self._committed_step)):
            self._save(step)
        self._call_step = step
        predicted, losses = [], []
        spare = None   # the batch of the steps past this rank's own (DDP ranks only)
        if own < steps and n:
            spare = batch_slice(chunk["batch"], 0, min(n, size), n)
        elif own < steps and shadow is not None and int(shadow["n"]):
            spare = batch_slice(shadow["batch"], 0, min(int(shadow["n"]), size),
                                int(shadow["n"]))
        for i in range(steps):
            batch = batch_slice(chunk["batch"], i * size, min(n, (i + 1) * size), n) \
                if i * size < n else None
            predictions, loss = prequential_step(self.model, self.optimizer, batch,
                                                self.predict, self.loss, spare)
            if batch is not None:
                predicted.append(predictions)
                losses.append(loss.detach())
        # every rank adds every rank's chunk, in rank order (the stream order of a call)
        pairs = [(chunk["batch"]["y"].tolist(), torch.cat(predicted).tolist())
                 if n else ([], [])]
        if self.context.backend:
            import torch.distributed as dist

            if dist.is_initialized():
                gathered: list = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, pairs[0])
                pairs = gathered
        before = self.stats.correct
        for labels, predicted_labels in pairs:
            self.stats.update(labels, predicted_labels)
        correct = self.stats.correct - before
        if self._id_log is not None and n:
            ledger.write_trained(self._id_log, chunk["ids"], step)
        self.progress = {"step": step + steps, "records": int(records),
                         "offsets": dict(offsets), "prequential": self.stats.state()}
        every_p = self.odl.publish_every
        if self.rank == 0 and (publish or (every_p and (step + steps) // every_p
                                           > step // every_p)):
            self._publish()
        return {"n": n, "correct": correct if self.rank == 0 else 0,
                "loss": float(torch.stack(losses).mean()) if losses else float("nan"),
                "prequential": self.stats.metrics() if self.rank == 0 else None,
                "committed": self._newly_committed()}

    def teardown(self) -> None:
        if getattr(self, "_id_log", None) is not None:
            self._id_log = self._id_log.close()

    def _publish(self) -> None:
        from dlrover_plugin_odl.publish import publish

        step = int(self.progress["step"])
        publish(os.path.join(self.job_dir or ".", "published"), step,
                unwrap(self.model).state_dict(),
                {"step": step, "records": self.progress["records"], "time": time.time()})
        self.published = step

    def finish(self) -> dict:
        """End of the stream: checkpoint the final progress (so everything trained is
        committed) and publish the final model. Returns ``{"committed", "published"}``."""
        step = int(self.progress["step"])
        if step > 0 and step not in self._awaiting and step != self._committed_step:
            self._save(step)
        self.checkpointer.wait()
        if self.rank == 0 and step > 0 and self.published != step:
            self._publish()
        if self._id_log is not None:
            self._id_log.close()
            self._id_log = None
        return {"committed": self._newly_committed(), "published": self.published}


# ---------------------------------------------------------------------------- eval
class EvalWorkload(BaseWorkload):
    """The optional ``eval`` role: scores the live stream with the newest published
    model version (reloaded whenever a newer one appears). Records that arrive
    before any version is published are counted as ``unscored``."""

    def build_model(self) -> torch.nn.Module:
        raise NotImplementedError(f"{type(self).__name__}.build_model() is not implemented")

    def predict(self, model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return model(batch["x"]).argmax(dim=-1)

    def setup(self) -> None:
        self.model = self.build_model()
        self.model.eval()
        self.directory = os.path.join(self.job_dir or ".", "published")
        self.version: int | None = None
        self.counts: collections.Counter = collections.Counter()

    def _refresh(self) -> None:
        from dlrover_plugin_odl.publish import latest_version, load_latest

        latest = latest_version(self.directory)
        if latest is None or latest == self.version:
            return
        got = load_latest(self.directory)
        if got is not None and got[0] != self.version:
            self.model.load_state_dict(got[1])
            self.version = got[0]

    def score(self, chunk: dict) -> dict:
        """``{"n", "correct", "unscored", "version"}`` for one preprocessed chunk."""
        self._refresh()
        n = int(chunk["n"])
        if self.version is None:
            return {"n": 0, "correct": 0, "unscored": n, "version": -1}
        with torch.no_grad():
            correct = int((self.predict(self.model, chunk["batch"]) == chunk["batch"]["y"]).sum())
        return {"n": n, "correct": correct, "unscored": 0, "version": self.version}
