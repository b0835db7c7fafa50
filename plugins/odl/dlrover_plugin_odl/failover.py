"""The ``odl`` driver's in-place replacement of ``preprocess`` ranks: a part of
:class:`~dlrover_plugin_odl.driver.ODLTrainer` (it owns the record of the replacements;
the driver's queues of chunks and calls stay the driver's, read and re-sent here), run
on the driver's thread.

A ``preprocess`` rank whose ``roles.preprocess.config.failover`` is ``replace`` (the
template's default) is replaced by the master while the driver keeps running. When a
call fails (a trainer call or an eval score that needed a lost batch), the driver
finds the dead preprocess ranks (``RoleGroup.dead_ranks``), waits for their
replacements (``RoleGroup.await_replacement``), processes every chunk the dead ranks
had again on the replacements (its records are still in the object store, owned by the
source), lets the trainer calls already sent settle, checks the trainer is at the
first call that failed and sends it and the calls after it again, in order
(:meth:`PreprocessFailover.recover`). A trainer call that failed on a lost batch never
ran (``train_step`` refuses a step the trainer is not at), so nothing is trained twice.
With several trainer ranks, a call is sent only when its batches are ready and none was
lost (a rank whose batch was lost would leave the others waiting in DDP).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

#: in-place recoveries of preprocess ranks one failed call may trigger before the
#: failure restarts the driver
MAX_REPLACEMENTS = 3


@dataclass
class Call:
    """One trainer call in flight: its chunks (the driver's ``_Chunk``), the step it
    starts at, the stream offsets and record count it was sent with, its optimizer
    steps, the ``ObjectRef`` of each trainer rank's ``train_step``, and whether the
    driver's clock asked it to save its starting step and to publish
    (``config.odl.checkpoint_every_s``, ``publish_every_s``; kept when it is sent again)."""

    chunks: list
    step: int
    offsets: dict
    records: int
    steps: int
    refs: list
    save: bool = False
    publish: bool = False


class PreprocessFailover:
    """The driver ``driver``'s replacement of dead ``preprocess`` ranks (on: the
    role's failover policy is ``replace``). ``retries``: one dict per in-place
    recovery (``roles``, ``resent_calls``, ``reprocessed_chunks``, ``seconds``,
    ``error``)."""

    def __init__(self, driver: Any, on: bool) -> None:
        self.d = driver
        #: roles replaced under the driver
        self.replaceable = ["preprocess"] if on else []
        self.retries: list[dict[str, Any]] = []

    def send(self, call: Call) -> None:
        """Send ``call`` to every trainer rank: a rank without a chunk gets rank 0's as
        its shadow (it joins the DDP collectives on it with a zero gradient). With
        several ranks and a replaceable preprocess, first wait until the call's
        batches are ready and process again those a dead rank lost.

        Raises:
            RuntimeError: the call's batches were lost more than
                :data:`MAX_REPLACEMENTS` times.
        """
        d = self.d
        if len(d.trainers) > 1 and self.replaceable:
            for _ in range(MAX_REPLACEMENTS + 1):
                batches = [c.batch for c in call.chunks]
                ray.wait(batches, num_returns=len(batches), fetch_local=False)
                dead = d.groups["preprocess"].dead_ranks()
                if not any(c.pre in dead for c in call.chunks):
                    break
                self._replace({"preprocess": dead}, None, [call])
            else:
                raise RuntimeError(f"the batches of trainer step {call.step} were lost "
                                   f"{MAX_REPLACEMENTS + 1} times")
        chunks = call.chunks
        call.refs = [h.call.remote("train_step", call.step,
                                   chunks[r].batch if r < len(chunks) else None,
                                   call.offsets, call.records, call.steps,
                                   None if r < len(chunks) else chunks[0].batch,
                                   call.save, call.publish)
                     for r, h in enumerate(d.trainers)]

    def retrying(self, get: Callable[[], Any]) -> Any:
        """``get()``; when it fails and :meth:`recover` replaced preprocess ranks (and
        sent again what was in flight on them), ``get()`` again, at most
        :data:`MAX_REPLACEMENTS` times. Otherwise ``get()``'s error is raised."""
        for n in range(MAX_REPLACEMENTS + 1):
            try:
                return get()
            except Exception as exc:  # noqa: BLE001 - re-raised unless a rank was replaced
                if n == MAX_REPLACEMENTS or not self.recover(exc):
                    raise
        raise AssertionError("unreachable")

    def recover(self, exc: BaseException, wait_s: float = 20.0) -> bool:
        """After a call failed (``exc``): when ranks of the replaceable roles are dead,
        wait for the master's replacements and send again on them what was in flight
        (:meth:`_replace`); True. False when no such rank is dead (the failure is
        someone else's: the caller re-raises it and the master restarts the driver).

        Ray may fail a call that needed a dead actor's result a moment before a ping
        sees the actor dead: the ranks are probed for up to ``wait_s`` seconds when
        ``exc`` says an actor or an object was lost."""
        if not self.replaceable:
            return False
        lost = any(t in f"{type(exc).__name__} {exc}" for t in
                   ("ActorDied", "OwnerDied", "ActorError", "ObjectLost", "ActorUnavailable"))
        deadline = time.monotonic() + (wait_s if lost else 0.0)
        while True:
            dead = {r: self.d.groups[r].dead_ranks() for r in self.replaceable}
            dead = {r: ranks for r, ranks in dead.items() if ranks}
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not dead:
            return False
        self._replace(dead, exc, list(self.d._training))
        return True

    def _replace(self, dead: dict[str, list[int]], exc: BaseException | None,
                 calls: list[Call]) -> None:
        """Wait for the replacements of ``dead`` (role -> ranks), process every chunk
        the dead ranks had (waiting, in ``calls``, in eval) again on them, then send
        again, in order, the driver's calls in training from the first that failed
        (after checking that the trainer is at its step: the calls that failed never
        ran) and the eval scores that failed.

        Raises:
            RuntimeError: the trainer is not at the step of the first failed call.
            TimeoutError: the master did not replace a rank (``await_replacement``).
        """
        d = self.d
        t0 = time.perf_counter()
        master = d.master_handle
        group = d.groups["preprocess"]
        for rank in dead.get("preprocess", []):
            group.await_replacement(master, rank)
        d.preprocess = list(group.handles)
        d.__dict__.pop("actor_handles", None)  # it held the old handles
        redo = set(dead.get("preprocess", []))
        chunks = [c for c in d._fifo if c.batch is not None]
        chunks += [c for call in d._training for c in call.chunks]
        chunks += [c for call in calls for c in call.chunks]
        chunks += [c for c, _, _ in d._eval_refs]
        seen: set[int] = set()
        for c in chunks:
            if c.pre in redo and id(c) not in seen:
                seen.add(id(c))
                d._process(c, c.pre)
        # the trainer runs its calls in order: let those already sent settle, then send
        # again the first that failed and every later one (those failed on the step)
        sent = [call for call in d._training if call.refs]
        first = None
        for k, call in enumerate(sent):
            ray.wait(call.refs, num_returns=len(call.refs))
            try:
                ray.get(call.refs)
            except Exception:  # noqa: BLE001 - sent again below
                first = k
                break
        if first is not None:
            at = int(ray.get(d.trainers[0].call.remote("resume_state"))["step"])
            if at != sent[first].step:
                raise RuntimeError(f"trainer at step {at} after its call for step "
                                   f"{sent[first].step} failed: it cannot be sent again")
            for call in sent[first:]:
                self.send(call)
        for k, (c, e, ref) in enumerate(d._eval_refs):
            ray.wait([ref])
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - scored again on the replacement's batch
                d._eval_refs[k] = (c, e, d.evals[e].call.remote("score", c.batch))
        self.retries.append({"roles": {r: list(v) for r, v in dead.items()},
                             "resent_calls": 0 if first is None else len(sent) - first,
                             "reprocessed_chunks": len(seen),
                             "seconds": round(time.perf_counter() - t0, 3),
                             "error": "" if exc is None else
                             f"{type(exc).__name__}: {str(exc)[:200]}"})
        print(f"[odl driver] {dead} replaced after {time.perf_counter() - t0:.2f} s; "
              f"{len(seen)} chunks processed again, "
              f"{self.retries[-1]['resent_calls']} trainer calls sent again", flush=True)
