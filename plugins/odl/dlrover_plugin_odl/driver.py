"""The driver of ``odl`` jobs: streams chunks source -> preprocess -> trainer (+ eval).

Per chunk (up to ``config.odl.batch_size * chunk_batches`` records of one partition)::

    meta  = source[p].read(chunk_size)         # records stay in the object store
    batch = preprocess[j].process(meta.data)   # worker-to-worker; j round-robin
    trainer[r].train_step(step, batch, ..., steps)  # one chunk per trainer rank per call
    eval[k].score(batch)                       # optional, newest published model

A trainer call runs ``steps`` optimizer steps, one per ``batch_size`` records: the
most batches any rank's chunk of the call has (:meth:`OnlineTrainerWorkload.
train_step`); ``step`` counts optimizer steps.

Backpressure: at most ``config.odl.buffer`` chunks are between the source and the
trainer (read, in preprocessing, waiting, or in a trainer step not yet finished);
the driver asks a source for the next chunk only when one has been trained, so a
slow trainer slows the source and at most ``buffer * chunk_size`` records are in
flight. Chunks of one partition are read, and trained, in order. Up to
``train_depth`` calls are sent to the trainer ahead (it runs them in order), so the
next is ready when one finishes.

Delivery (at-least-once): the trainer checkpoints its progress with the stream
offsets (partition -> position of the last trained record) in the same commit as
its model. A (re)started driver asks trainer rank 0 for the progress of the model
in memory (after a trainer restart: the checkpoint it loaded) and seeks every
source partition there. When the trainer reports a newly committed checkpoint, the
driver tells each source partition to ``commit`` its offset (Redis: ``XACK``).
Offsets of partitions ``k`` >= the number of sources (a job resumed with fewer) go
to source ``k % n``, with the seek and with every commit: it delivers what is left
of them first, under key ``k`` (see :meth:`StreamSourceBase.take_over`).

Failover: a ``preprocess`` rank whose ``roles.preprocess.config.failover`` is ``replace``
(the template's default) is replaced while this driver keeps running
(:class:`~dlrover_plugin_odl.failover.PreprocessFailover`).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import ray

from dlrover_core import BaseTrainer
from dlrover_plugin_odl.config import ODLConfig
from dlrover_plugin_odl.failover import Call, PreprocessFailover
from dlrover_plugin_odl.prequential import PrequentialStats


@dataclass
class _Chunk:
    partition: int
    read: Any                  # ObjectRef of the source's metadata
    meta: dict | None = None
    batch: Any = None          # ObjectRef of the preprocessed chunk
    empty: bool = False
    pre: int = -1              # the preprocess rank that was asked for ``batch``


class ODLTrainer(BaseTrainer):
    """Runs the stream until the source ends or ``max_records`` / ``max_time_s`` /
    ``idle_timeout_s`` is reached.

    Metrics reported every ``config.odl.report_every`` steps (``summary.json`` keeps
    the last): ``records`` (trained, all restarts included), ``prequential_accuracy``
    (correct test-then-train predictions / records), ``kappa``, ``kappa_temporal``,
    ``baseline_no_change_accuracy``, ``baseline_majority_accuracy`` (see
    :mod:`dlrover_plugin_odl.prequential`; kept by the trainer with its checkpoint,
    so a restart of the driver or the trainer does not reset them),
    ``window_accuracy`` (over the latest trainer calls of this driver attempt that
    hold at least ``window`` records: whole chunks),
    ``records_per_s`` (records trained by this driver attempt / its seconds),
    ``loss``, ``buffered_records`` (records the sources have read minus records
    trained, from the sources' own counters: the backpressure bound),
    ``in_flight_chunks``, ``max_in_flight_chunks``, ``source_read_records`` and the
    sources' other counters (``broker_reconnects``...; these and
    ``buffered_records`` as of the previous report, when the driver asked the
    sources without waiting; the last report's as of the end), ``committed_step``,
    ``published_version``; with an ``eval`` role ``eval_accuracy``, ``eval_records``,
    ``eval_version``. The last report also has ``steps``, ``preprocess_replaced``
    (in-place recoveries of preprocess ranks by this driver attempt),
    ``stop_reason_end_of_stream`` (1.0 or 0.0) and, with ``config.odl.log_record_ids``
    (the default), ``lost``, ``duplicated`` and ``retrained`` (records, counted from
    the job's record logs: :func:`dlrover_plugin_odl.ledger.count`).
    """

    def init(self) -> None:
        self.odl = ODLConfig.from_config(self.config)
        groups = self._context.role_groups
        for role in ("source", "preprocess", "trainer"):
            if role not in groups:
                raise ValueError(f"an odl job needs a {role!r} role; it has {sorted(groups)}")
        self.sources = list(groups["source"].handles)
        self.preprocess = list(groups["preprocess"].handles)
        self.trainers = list(groups["trainer"].handles)
        self.evals = list(groups["eval"].handles) if "eval" in groups else []
        self.groups = groups
        #: the in-place replacement of preprocess ranks (``roles.preprocess.config.
        #: failover`` = ``replace``, asked now while every role is up)
        self.failover = PreprocessFailover(self, self._policy("preprocess") == "replace")
        if self.odl.buffer < len(self.trainers):
            raise ValueError(f"config.odl.buffer={self.odl.buffer} is smaller than the "
                             f"{len(self.trainers)} trainer ranks: a trainer call needs "
                             "one chunk per rank")
        progress = ray.get(self.trainers[0].call.remote("resume_state"))
        self.step = int(progress["step"])
        self.records = int(progress["records"])
        # the trainer's counters (in its memory, or from the checkpoint it loaded):
        # a restarted driver goes on counting where the model is
        self.prequential = PrequentialStats.from_state(progress.get("prequential")).metrics()
        self.offsets: dict[str, Any] = dict(progress["offsets"])
        self.restored_step = progress.get("restored_step")
        # departed partitions (offsets k >= the number of sources: a job resumed with
        # fewer) go to source k % n, which delivers what is left of them first
        n = len(self.sources)
        departed: dict[int, dict[str, Any]] = collections.defaultdict(dict)
        for k, pos in self.offsets.items():
            if int(k) >= n:
                departed[int(k) % n][k] = pos
        ray.get([h.call.remote("seek", self.offsets.get(str(p)), departed.get(p, {}))
                 for p, h in enumerate(self.sources)])

    def _policy(self, role: str) -> str:
        """``failover_policy()`` of ``role``'s rank 0, or ``rollback`` when its workload
        class has none (one that does not subclass ``PreprocessWorkload``)."""
        if not callable(getattr(self.actor_classes.get(role), "failover_policy", None)):
            return "rollback"
        return str(ray.get(self.groups[role].handles[0].call.remote("failover_policy")))

    # ------------------------------------------------------------------ the pipeline
    def _refill(self, fifo: collections.deque, exhausted: set) -> None:
        n = len(self.sources)
        while len(fifo) + self._training_chunks < self.odl.buffer and len(exhausted) < n:
            p = self._next_partition
            self._next_partition = (p + 1) % n
            if p in exhausted:
                continue
            fifo.append(_Chunk(p, self.sources[p].call.remote("read", self.odl.chunk_size)))

    def _resolve(self, c: _Chunk, exhausted: set) -> None:
        """Fetch the chunk's metadata (blocking) and start its preprocessing."""
        if c.meta is not None:
            return
        c.meta = ray.get(c.read)
        if c.meta["end"]:
            exhausted.add(c.partition)
        if not c.meta["n"]:
            c.empty = True
            return
        self._last_record_t = time.monotonic()
        j = self._next_pre
        self._next_pre = (j + 1) % len(self.preprocess)
        self._process(c, j)

    def _process(self, c: _Chunk, j: int) -> None:
        c.pre = j
        c.batch = self.preprocess[j].call.remote("process", c.meta["data"][0])

    def _resolve_ready(self, fifo: collections.deque, exhausted: set) -> None:
        """Start preprocessing every chunk whose read has finished (no waiting)."""
        pending = [c.read for c in fifo if c.meta is None]
        if not pending:
            return
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        ready_set = set(ready)
        for c in fifo:
            if c.meta is None and c.read in ready_set:
                self._resolve(c, exhausted)

    def _take_step_chunks(self, fifo: collections.deque, exhausted: set) -> list[_Chunk]:
        """The next chunk for each trainer rank, in stream order (fewer at the end of the
        stream; none while the buffer is full of chunks in training)."""
        out: list[_Chunk] = []
        while len(out) < len(self.trainers):
            idx = len(out)
            if idx >= len(fifo):
                self._refill(fifo, exhausted)
                if idx >= len(fifo):  # the buffer is full of chunks in training, or the end
                    return out if len(exhausted) == len(self.sources) else []
            c = fifo[idx]
            self._resolve(c, exhausted)
            if c.empty:
                del fifo[idx]
                if self._stop_reason() is not None:
                    break
                continue
            out.append(c)
        return out

    def _stop_reason(self) -> str | None:
        o = self.odl
        if o.max_records and self._issued_records >= o.max_records:
            return "max_records"
        if o.max_time_s and time.monotonic() - self._t0 >= o.max_time_s:
            return "max_time_s"
        if o.idle_timeout_s and time.monotonic() - self._last_record_t >= o.idle_timeout_s:
            return "idle_timeout_s"
        return None

    # ------------------------------------------------------------------ commits and eval
    def _due_by_time(self) -> tuple[bool, bool]:
        """(save, publish) for the next trainer call by the driver's clock:
        ``config.odl.checkpoint_every_s`` / ``publish_every_s`` passed since the stream
        started or since the call that last asked (0: never)."""
        now, due = time.monotonic(), []
        for k, every in (("save", self.odl.checkpoint_every_s),
                         ("publish", self.odl.publish_every_s)):
            ok = bool(every) and now - self._asked_t[k] >= every
            if ok:
                self._asked_t[k] = now
            due.append(ok)
        return due[0], due[1]

    def _commit(self, committed: dict | None) -> None:
        if not committed:
            return
        ray.get(self._commit_refs)  # surface a failed commit of the previous round
        n = len(self.sources)
        self._commit_refs = [self.sources[int(p) % n].call.remote("commit", pos, int(p))
                             for p, pos in committed["offsets"].items()]
        self.committed_step = committed["step"]

    def _score(self, chunks: list[_Chunk]) -> None:
        for c in chunks:
            k = self._next_eval
            self._next_eval = (k + 1) % len(self.evals)
            self._eval_refs.append((c, k, self.evals[k].call.remote("score", c.batch)))
        while len(self._eval_refs) > self.odl.buffer:
            self._eval_add(self.failover.retrying(lambda: ray.get(self._eval_refs[0][2])))
            self._eval_refs.popleft()

    def _eval_add(self, out: dict) -> None:
        self._eval["n"] += out["n"]
        self._eval["correct"] += out["correct"]
        self._eval["unscored"] += out["unscored"]
        self._eval["version"] = max(self._eval["version"], out["version"])

    def _source_stats(self, refs: list | None = None) -> dict[str, float]:
        """The sources' counters summed (``refs``: of ``stats`` calls already sent)."""
        totals: dict[str, float] = {}
        for st in ray.get(refs or [h.call.remote("stats") for h in self.sources]):
            for k, v in st.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return totals

    def _source_stats_sent_before(self) -> tuple[dict[str, float], int]:
        """The sources' counters as of the previous report, when they were asked for
        (so a report does not wait for a source in the middle of a read), and the
        records trained then; the first time, fetched now."""
        sent, self._stats_sent = self._stats_sent, (
            [h.call.remote("stats") for h in self.sources], self.records)
        if sent is None:
            return self._source_stats(), self.records
        return self._source_stats(sent[0]), sent[1]

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        self._t0 = self._last_record_t = time.monotonic()
        self._asked_t = {"save": self._t0, "publish": self._t0}   # _due_by_time
        self._next_partition = self._next_pre = self._next_eval = 0
        self._commit_refs: list = []
        self._eval_refs: collections.deque = collections.deque()
        self._eval = {"n": 0, "correct": 0, "unscored": 0, "version": -1}
        self.committed_step = self.restored_step if self.restored_step is not None else -1
        self.published = -1
        fifo: collections.deque[_Chunk] = collections.deque()
        exhausted: set[int] = set()
        window: collections.deque[tuple[int, int]] = collections.deque()
        win_n = win_c = 0
        start_records, max_in_flight = self.records, 0
        self._src_base = self._source_stats().get("source_read_records", 0.0)
        self._stats_sent: tuple[list, int] | None = None
        self._training_chunks = 0
        # calls sent to the trainer and not yet finished, oldest first: the trainer
        # runs them in order; the driver prepares the next while one trains
        training: collections.deque[Call] = collections.deque()
        self._fifo, self._training = fifo, training
        issued_offsets, next_step = dict(self.offsets), self.step
        self._issued_records = self.records
        metrics: dict[str, float] = {}
        reason = None
        while True:
            if reason is None:
                reason = self._stop_reason()
            chunks: list[_Chunk] = []
            if reason is None and len(training) < self.odl.train_depth:
                self._refill(fifo, exhausted)
                max_in_flight = max(max_in_flight, len(fifo) + self._training_chunks)
                self._resolve_ready(fifo, exhausted)
                chunks = self._take_step_chunks(fifo, exhausted)
                if not chunks and not fifo and len(exhausted) == len(self.sources):
                    reason = "end_of_stream"
            if chunks:
                for _ in chunks:
                    fifo.popleft()
                self._training_chunks += len(chunks)
                issued_offsets = dict(issued_offsets)
                for c in chunks:
                    issued_offsets[c.meta["key"]] = c.meta["last"]
                self._issued_records += sum(c.meta["n"] for c in chunks)
                size = self.odl.batch_size
                steps = max(1, max(-(-c.meta["n"] // size) for c in chunks))
                call = Call(chunks, next_step, issued_offsets, self._issued_records, steps,
                             [], *self._due_by_time())
                self.failover.send(call)
                next_step += steps
                training.append(call)
                if self.evals:
                    self._score(chunks)
                self._resolve_ready(fifo, exhausted)  # overlap preprocessing with training
                if len(training) < self.odl.train_depth and reason is None:
                    continue
            if not training:
                if reason is not None:
                    break
                continue
            results = self.failover.retrying(lambda: ray.get(training[0].refs))
            done = training.popleft()
            self._training_chunks -= len(done.chunks)
            before = self.step
            self.step += done.steps
            self.offsets, self.records = done.offsets, done.records
            n = sum(r["n"] for r in results)
            c_ok = sum(r["correct"] for r in results)
            self.prequential = results[0]["prequential"]
            window.append((n, c_ok))
            win_n, win_c = win_n + n, win_c + c_ok
            while window and win_n - window[0][0] >= self.odl.window:
                a, b = window.popleft()
                win_n, win_c = win_n - a, win_c - b
            self._commit(results[0]["committed"])
            if self.step // self.odl.report_every > before // self.odl.report_every:
                metrics = self._metrics(results, start_records,
                                        len(fifo) + self._training_chunks, max_in_flight,
                                        win_n, win_c)
                self.report(self.step, **metrics)
        # end: commit everything trained, publish the final model
        outs = ray.get([h.call.remote("finish") for h in self.trainers])
        self._commit(outs[0]["committed"])
        ray.get(self._commit_refs)
        self.published = outs[0]["published"] if outs[0]["published"] is not None else -1
        while self._eval_refs:
            self._eval_add(self.failover.retrying(lambda: ray.get(self._eval_refs[0][2])))
            self._eval_refs.popleft()
        metrics = self._metrics([], start_records, len(fifo), max_in_flight, win_n, win_c,
                                final=True)
        metrics["stop_reason_end_of_stream"] = float(reason == "end_of_stream")
        metrics["steps"] = float(self.step)
        metrics["preprocess_replaced"] = float(len(self.failover.retries))
        if self.odl.log_record_ids and self.job_dir:
            from dlrover_plugin_odl.ledger import count

            tally = count(self.job_dir, self.offsets, reason == "end_of_stream")
            metrics.update(lost=tally["lost"], duplicated=tally["duplicated"],
                           retrained=tally["retrained"])
        self.report(self.step, **metrics)
        return metrics

    def _metrics(self, results: list[dict], start_records: int, in_flight: int,
                 max_in_flight: int, win_n: int, win_c: int,
                 final: bool = False) -> dict[str, float]:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        losses = [r["loss"] for r in results if r["n"]]
        # the last report: the sources' counters now
        src, trained = ((self._source_stats(), self.records) if final
                        else self._source_stats_sent_before())
        m: dict[str, float] = {
            "records": float(self.records),
            **self.prequential,
            "window_accuracy": win_c / win_n if win_n else 0.0,
            "records_per_s": (self.records - start_records) / elapsed,
            "in_flight_chunks": float(in_flight),
            "max_in_flight_chunks": float(max_in_flight),
            "committed_step": float(self.committed_step),
            "published_version": float(max(self.published, self._latest_published())),
            **src,
        }
        if "source_read_records" in src:
            read = src["source_read_records"] - self._src_base
            m["buffered_records"] = read - (trained - start_records)
        if losses:
            m["loss"] = sum(losses) / len(losses)
        if self.evals:
            e = self._eval
            m["eval_records"] = float(e["n"])
            m["eval_unscored"] = float(e["unscored"])
            m["eval_version"] = float(e["version"])
            if e["n"]:
                m["eval_accuracy"] = e["correct"] / e["n"]
        return m

    def _latest_published(self) -> int:
        import os

        from dlrover_plugin_odl.publish import latest_version

        v = latest_version(os.path.join(self.job_dir or ".", "published"))
        return -1 if v is None else v
