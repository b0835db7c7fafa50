"""The driver of ``multimodal`` jobs.

Per step the driver holds only sample ids and scalars; the samples are read and
encoded by the encoder roles and reach the trainer ranks worker to worker::

    ids = the step's share of this epoch's permutation of the train split
    for each encoder role:                               # non-blocking: DRefs
        frozen    -> role.embed("train", ids)            # [n, d] embeddings (cached)
        trainable -> role.inputs("train", ids)           # preprocessed samples
    trainer.train_step(step, ids, {modality: refs})      # every rank fetches its share

The encoder calls of the next ``prefetch`` steps are issued before the trainer's
step is awaited, so encoding overlaps training.

Commits (issue 57): every ``checkpoint.every_steps`` steps (every step when 0) and at
the last step the driver commits (``BaseTrainer.commit_roles``): the trainer saves its
model, optimizer, step, samples trained and RNG with the job's saver, then the
driver's state is written; only then are the steps it holds reported, so a step is
reported once. A (re)started driver puts the trainer back to that commit
(``BaseTrainer.resume_roles``) and goes on from there: a killed trainer or driver
costs at most the steps since the last commit, which are trained again from the same
state on the same batches.

Encoders are stateless (``roles.<encoder>.config.failover: replace``, the template's
default): when an encoder rank dies, the master replaces it and keeps this driver
running (``dlrover_core.master.failover.graph_scope``). The step's call that lost the
encoder's output fails on every trainer rank before any trains
(:class:`~dlrover_plugin_multimodal.fusion.UpstreamLost`); the driver then waits for the
replacement (``RoleGroup.dead_ranks`` / ``await_replacement``, as PPO's driver does for
its rollouts), encodes again, on the replacement, the ids of that step and of the steps
it had prefetched, and retries the step: no driver restart, no rollback, no step
trained twice (:meth:`MultimodalDriver.recover_encoders`).
"""

from __future__ import annotations

import collections
import json
import os
import random
import time
from typing import Any, Callable, TypeVar

import ray

from dlrover_core import BaseTrainer
from dlrover_plugin_multimodal.config import TRAINER, MultimodalConfig
from dlrover_plugin_multimodal.dataset import load_dataset
from dlrover_plugin_multimodal.handoff import EncodedRefs

T = TypeVar("T")
#: in-place recoveries of replaced encoders the driver tries for one call before it
#: gives up (raises: the master then restarts it)
MAX_ENCODER_RETRIES = 3


def _bundle_index(assigned: dict[str, float]) -> int | None:
    try:
        from dlrover_core.placement import bundle_index
    except ImportError:  # the core before placement moved out of master/
        from dlrover_core.master.placement import bundle_index
    return bundle_index(assigned)


def mean_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Average each scalar over the ranks that reported it; ``samples`` is summed and
    ``step_s`` / ``fetch_s`` take the slowest rank."""
    out: dict[str, float] = {}
    for k in sorted({k for d in per_rank for k in d}):
        vals = [float(d[k]) for d in per_rank if k in d]
        if k == "samples":
            out[k] = sum(vals)
        elif k in ("step_s", "fetch_s"):
            out[k] = max(vals)
        else:
            out[k] = sum(vals) / len(vals)
    return out


class MultimodalDriver(BaseTrainer):
    """Runs a ``multimodal`` job: streams batches from the encoder roles to the trainer.

    Metrics reported each step, once the commit holding it is written (``summary.json``
    keeps the last): the trainer's ``loss`` and other metrics averaged over ranks,
    ``trained_samples`` (samples of every step the model trained on, counted once:
    restored with the trainer's commit), ``epoch``, ``samples_per_s``,
    ``step_s``, ``fetch_s`` (slowest trainer rank); at each epoch's end, per encoder
    role, its ``stats()`` summed over its ranks as ``<role>_<counter>``
    (``embedded``, ``cache_hits``, ``cache_misses``, ``cache_size`` of a frozen
    encoder, ``loaded`` of a trainable one; counts since each rank's process started). With
    ``config.multimodal.evaluate``, every metric ``m`` of the trainer's
    ``evaluate`` as ``m_untrained`` (before the first step) and ``m`` (after the last).
    """

    def init(self) -> None:
        self.mm = MultimodalConfig.from_config(self.config)
        self.dataset = load_dataset(self.mm.dataset, self.mm.modalities, self.mm.data_options)
        self.train_ids = [int(i) for i in self.dataset.sample_ids("train")]
        bs = self.mm.batch_size
        self.steps_per_epoch = len(self.train_ids) // bs
        if self.steps_per_epoch < 1:
            raise ValueError(f"config.multimodal.batch_size={bs} is larger than the train split "
                             f"({len(self.train_ids)} samples)")
        self.total_steps = self.mm.max_steps or self.mm.epochs * self.steps_per_epoch
        self.groups = {enc.role: getattr(self, f"RG_{enc.role.upper()}")
                       for enc in self.mm.encoders.values()}
        self.trainer = getattr(self, f"RG_{TRAINER.upper()}")
        self.placement = self.record_placement()
        # the trainer back to the last commit (a restarted one, or one that ran ahead
        # of it: this driver died before committing or reporting its steps)
        state = self.resume_roles() or {}
        steps = [int(s) for s in self.trainer.trained_steps()]
        if len(set(steps)) != 1 or steps[0] != int(state.get("committed_step", 0)):
            raise RuntimeError(f"trainer ranks at steps {steps} after the restore to the "
                               f"driver's commit {state.get('committed_step', 0)}")
        self.start_step = steps[0]
        self.commit_every = int(
            self.trainer.commit_interval.options(target="RANK0", blocking=True)())
        self.untrained: dict[str, float] | None = state.get("untrained")
        #: encoder roles replaced under this driver (``failover: replace``), asked now,
        #: while every role is up; the stateful roles of the commits too
        self.replaceable = [r for r in sorted(self.groups) if self._ask(r, "failover_policy",
                                                                        "rollback") == "replace"]
        _ = self.role_commits.stateful
        #: the in-place recoveries of this driver (:meth:`recover_encoders`)
        self.retries: list[dict[str, Any]] = []
        self.queued: collections.deque[tuple[int, list[int], dict]] = collections.deque()
        self.epoch_stats: dict[int, dict[str, Any]] = {}
        self.report_lost(state.get("reports") or [])

    def _ask(self, role: str, method: str, default: Any) -> Any:
        """``method()`` of ``role``'s rank 0, or ``default`` when its workload class has
        no such method (an encoder that does not subclass ``EncoderWorkload``)."""
        if not callable(getattr(self.actor_classes.get(role), method, None)):
            return default
        return getattr(self.groups[role], method).options(target="RANK0", blocking=True)()

    def report_lost(self, reports: list[tuple[int, dict[str, float]]]) -> None:
        """The reports of the last commit that the master never got (the driver died
        between the commit and its reports): sent now, once."""
        if not reports:
            return
        master = self.master_handle
        seen = int(ray.get(master.status.remote()).get("step", -1))
        for step, metrics in reports:
            if step > seen:
                self.report(step, **metrics)

    # ------------------------------------------------------------------ placement
    def record_placement(self) -> dict[str, Any]:
        """Where each role instance runs, as Ray reports it from the actors:
        ``{role: [{"rank", "node_id", "pid", "placement_group_id", "bundle",
        "resources"}]}`` plus ``driver``; written to ``<job dir>/placement.json``."""
        out: dict[str, Any] = {}
        for role, handles in self.actor_handles.items():
            infos = ray.get([h.node_info.remote() for h in handles])
            out[role] = [{"rank": r, "node_id": i["node_id"], "pid": i["pid"],
                          "placement_group_id": i["placement_group_id"],
                          "bundle": _bundle_index(i["assigned_resources"]),
                          "resources": i["assigned_resources"]}
                         for r, i in enumerate(infos)]
        out["driver"] = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}
        if self.job_dir:
            os.makedirs(self.job_dir, exist_ok=True)
            tmp = os.path.join(self.job_dir, "placement.json.tmp")
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1)
            os.replace(tmp, os.path.join(self.job_dir, "placement.json"))
        return out

    # ------------------------------------------------------------------ data
    def batch_ids(self, step: int) -> list[int]:
        """The sample ids of ``step``: slice ``step % steps_per_epoch`` of epoch
        ``step // steps_per_epoch`` 's permutation of the train split (seeded by
        ``seed`` and the epoch, so every driver computes the same)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        perm = list(self.train_ids)
        random.Random(self.mm.seed * 1_000_003 + epoch).shuffle(perm)
        bs = self.mm.batch_size
        return perm[k * bs:(k + 1) * bs]

    def encode(self, split: str, ids: list[int],
               modalities: tuple[str, ...] | None = None) -> dict[str, EncodedRefs]:
        """Start every encoder role on ``ids`` of ``split`` (non-blocking); returns the
        references the trainer fetches from, by modality."""
        out = {}
        for m in modalities or self.mm.modalities:
            enc = self.mm.encoder_of(m)
            group = self.groups[enc.role]
            method = "inputs" if enc.trainable else "embed"
            dref = getattr(group, method).options(blocking=False, auto_shard=True)(split, ids)
            out[m] = EncodedRefs.from_dref(dref, len(ids), m,
                                           "inputs" if enc.trainable else "embeddings")
        return out

    def request_encoder_stats(self) -> dict[str, Any]:
        """Start ``stats()`` on every encoder role (non-blocking). An actor runs its calls
        in order, so the counters cover exactly the work issued before this request."""
        return {role: group.stats.options(blocking=False)() for role, group in self.groups.items()}

    @staticmethod
    def collect_encoder_stats(requested: dict[str, Any]) -> dict[str, float]:
        """``<role>_<counter>`` summed over each encoder role's ranks."""
        out: dict[str, float] = {}
        for role, dref in requested.items():
            for d in dref.get():
                for k, v in d.items():
                    out[f"{role}_{k}"] = out.get(f"{role}_{k}", 0.0) + float(v)
        return out

    def evaluate(self) -> dict[str, float]:
        """The trainer's ``evaluate`` on the dataset's ``eval_inputs`` (every rank gets
        all of them); rank 0's metrics."""
        eval_ids = {m: (split, [int(i) for i in ids])
                    for m, (split, ids) in self.dataset.eval_inputs().items()}
        if not eval_ids:
            return {}
        refs = {}
        for m, (split, ids) in eval_ids.items():
            refs.update(self.encode(split, ids, (m,)))
        # every rank evaluates (a sharded model needs all ranks in its forward); rank 0's
        # metrics are reported
        return self.trainer.evaluate.options(auto_shard=False)(eval_ids, refs)[0]

    # ------------------------------------------------------------------ stateless failover
    def recover_encoders(self, exc: BaseException, wait_s: float = 20.0) -> list[str]:
        """After a call failed (``exc``): the encoder roles of :attr:`replaceable` that
        had dead ranks, once the master has replaced each of them and this driver's role
        groups point at the replacements; ``[]`` when no such rank is dead (the failure
        is someone else's: the caller re-raises it and the master restarts the driver).

        Ray may fail a call that needed a dead actor's result a moment before a ping
        sees the actor dead: the ranks are probed for up to ``wait_s`` seconds when
        ``exc`` says an upstream or an actor was lost."""
        lost = any(t in f"{type(exc).__name__} {exc}" for t in
                   ("UpstreamLost", "ActorDied", "OwnerDied", "ActorError", "ObjectLost"))
        deadline = time.monotonic() + (wait_s if lost else 0.0)
        while True:
            dead = {r: self.groups[r].dead_ranks() for r in self.replaceable}
            dead = {r: ranks for r, ranks in dead.items() if ranks}
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not dead:
            return []
        master = self.master_handle
        t0 = time.perf_counter()
        for role, ranks in dead.items():
            for rank in ranks:
                self.groups[role].await_replacement(master, rank)
        self.__dict__.pop("actor_handles", None)  # it held the old handles
        self.issue_again(sorted(dead))
        self.retries.append({"roles": {r: list(v) for r, v in dead.items()},
                             "seconds": round(time.perf_counter() - t0, 3),
                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        print(f"[multimodal driver] {dead} replaced after {time.perf_counter() - t0:.2f} s; "
              "retrying the step's calls on the replacement", flush=True)
        return sorted(dead)

    def _retrying(self, call: Callable[[], T],
                  on_replaced: Callable[[list[str]], None] | None = None) -> T:
        """``call()``; when it fails and :meth:`recover_encoders` replaced encoder roles,
        ``on_replaced(roles)`` (issue again what was in flight on them) and ``call()``
        again, at most :data:`MAX_ENCODER_RETRIES` times."""
        for n in range(MAX_ENCODER_RETRIES + 1):
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - re-raised unless an encoder was replaced
                replaced = self.recover_encoders(exc) if n < MAX_ENCODER_RETRIES else []
                if not replaced:
                    raise
                if on_replaced is not None:
                    on_replaced(replaced)
        raise AssertionError("unreachable")

    def issue_again(self, roles: list[str]) -> None:
        """What was in flight on ``roles`` (replaced), issued again on the replacements:
        the encoder calls of every prefetched step (:attr:`queued`) and the pending
        ``stats()`` requests (:attr:`epoch_stats`). Their old results were owned by the
        dead process, so a later call would fail on them after the recovery."""
        mods = self.modalities_of(roles)
        for k, (s, ids, refs) in enumerate(self.queued):
            self.queued[k] = (s, ids, {**refs, **self.encode("train", ids, mods)})
        self._request_again(self.epoch_stats, roles)

    def modalities_of(self, roles: list[str]) -> tuple[str, ...]:
        """The modalities encoded by ``roles``."""
        return tuple(m for m in self.mm.modalities if self.mm.encoder_of(m).role in roles)

    def train_step(self, step: int, ids: list[int],
                   refs: dict[str, EncodedRefs]) -> list[dict[str, float]]:
        """The trainer's ``train_step`` of ``step``, retried on replaced encoders (the
        ids of this step encoded again by them; the prefetched steps too,
        :meth:`issue_again`). A step whose encoder output was lost was trained by no
        trainer rank (``UpstreamLost``); the retry checks that the trainer is still at
        ``step``.

        Raises:
            RuntimeError: after the failure the trainer is not at ``step``.
        """
        current = {"refs": refs}

        def again(roles: list[str]) -> None:
            at = [int(s) for s in self.trainer.trained_steps()]
            if at != [step] * len(at):
                raise RuntimeError(f"trainer ranks at steps {at} after step {step} failed on "
                                   f"a lost encoder output; expected {step}")
            current["refs"] = {**current["refs"],
                               **self.encode("train", ids, self.modalities_of(roles))}

        return self._retrying(
            lambda: self.trainer.train_step.options(auto_shard=False)(step, ids, current["refs"]),
            again)

    def _request_again(self, epoch_stats: dict[int, dict[str, Any]], roles: list[str]) -> None:
        for requested in epoch_stats.values():
            for role in roles:
                if role in requested:
                    requested[role] = self.groups[role].stats.options(blocking=False)()

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        t_start = time.perf_counter()
        if self.mm.evaluate and self.untrained is None and self.start_step == 0:
            self.untrained = {f"{k}_untrained": v
                              for k, v in self._retrying(self.evaluate).items()}
            self.save_state({"untrained": self.untrained})
        final: dict[str, float] = dict(self.untrained or {})
        #: steps whose encoder calls are issued, not yet trained: (step, ids, refs)
        self.queued: collections.deque[tuple[int, list[int], dict]] = collections.deque()
        queued = self.queued
        next_issue = self.start_step
        metrics: dict[str, float] = {}
        last = self.start_step - 1
        #: last step of an epoch -> its encoders' stats() requests, not yet collected
        self.epoch_stats: dict[int, dict[str, Any]] = {}
        epoch_stats = self.epoch_stats
        unreported: list[tuple[int, dict[str, float]]] = []  # trained, not yet committed
        for step in range(self.start_step, self.total_steps):
            while next_issue < self.total_steps and next_issue <= step + self.mm.prefetch:
                if next_issue > self.start_step and next_issue % self.steps_per_epoch == 0:
                    epoch_stats[next_issue - 1] = self.request_encoder_stats()
                ids = self.batch_ids(next_issue)
                queued.append((next_issue, ids, self.encode("train", ids)))
                next_issue += 1
            s, ids, refs = queued.popleft()
            assert s == step
            t0 = time.perf_counter()
            per_rank = self.train_step(step, ids, refs)
            metrics = mean_over_ranks(per_rank)
            wall = time.perf_counter() - t0
            metrics["epoch"] = float(step // self.steps_per_epoch)
            metrics["samples_per_s"] = metrics.get("samples", len(ids)) / max(wall, 1e-9)
            metrics["elapsed_s"] = time.perf_counter() - t_start
            epoch_end = (step + 1) % self.steps_per_epoch == 0 or step + 1 == self.total_steps
            if epoch_end and step not in epoch_stats:  # nothing issued past it yet
                epoch_stats[step] = self.request_encoder_stats()
            if step in epoch_stats:
                requested = epoch_stats.pop(step)
                metrics.update(self._retrying(
                    lambda: self.collect_encoder_stats(requested),
                    lambda roles: self._request_again({step: requested}, roles)))
            unreported.append((step, {**metrics, **final}))
            if (step + 1) % self.commit_every == 0 or step + 1 == self.total_steps:
                # the commit, then the reports of the steps it holds: a step is
                # reported once, and never one that a restart throws away
                self.commit_roles(step + 1, {"untrained": self.untrained,
                                             "reports": list(unreported)})
                for s_done, m in unreported:
                    self.report(s_done, **m)
                unreported.clear()
            last = step
        after = self._retrying(self.evaluate) if self.mm.evaluate else {}
        final = {**metrics, **final, **after, "steps": float(self.total_steps),
                 "fit_s": time.perf_counter() - t_start}
        if self.retries:  # in-place recoveries of replaced encoders (none: no key)
            final["encoders_replaced"] = float(len(self.retries))
        self.report(max(last, 0), **final)
        return final


__all__ = ["MultimodalDriver", "mean_over_ranks"]
