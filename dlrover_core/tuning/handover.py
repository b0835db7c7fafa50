"""Serving a loader iterator's already-dispatched batches across a settings change.

When ``ElasticDataLoader.reconfigure`` changes ``num_workers`` or ``batch_size``, the
old ``DataLoader`` iterator has batches loaded or being loaded by its workers. Dropping
them (what a rebuilt ``DataLoader`` does) makes the next steps wait for the new workers
to start and read a whole wave of batches: on an input-bound job a stall of one or two
seconds at every switch, measured in the tuned benchmark's step records. A
:class:`Handover` instead serves those batches first, re-cut to the new ``batch_size``
when it changed, while the new iterator's workers start and load what follows.

Re-cutting concatenates and slices along dim 0, so it needs a batch made of tensors
(possibly nested in tuples, lists or dicts, as ``default_collate`` builds them) whose
dim-0 sizes agree; :func:`splittable` says whether a batch is one. Otherwise only a
change that keeps ``batch_size`` is handed over.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Iterator


class IndexBatches:
    """Batch sampler of one loader iterator: ``indices`` (this rank's indices of
    ``epoch``) from position ``start`` on, in batches of ``batch_size``, then, with
    ``next_epoch``, each following epoch's indices (``next_epoch(e)``) in turn, so that
    one iterator and its worker processes serve epoch after epoch: the workers load the
    next epoch's first batches while the current epoch's tail is served, and are not
    stopped and started again at each epoch (what ``DataLoader(persistent_workers=True)``
    saves, here without waiting for the epoch's end). ``drop_last`` drops each epoch's
    last batch when it is short; an epoch left without a batch ends the chain.

    Runs in the loader's main process (the ``DataLoader`` iterator draws indices from
    it to dispatch to its workers). ``dispatched`` counts the batches handed out, none
    after ``limit`` (``None``: no limit); ``order`` holds ``(epoch, samples)`` of every
    batch handed out and not yet taken back by :meth:`taken`, in order (the ``DataLoader``
    yields batches in the order of their indices); ``counts[e]`` is how many batches of
    epoch ``e`` were handed out, ``shards[e]`` epoch ``e``'s indices and ``ends[e]`` the
    position in them where its batches end (:meth:`forget` drops past epochs)."""

    def __init__(self, indices: list[int], batch_size: int, epoch: int = 0,
                 start: int = 0, drop_last: bool = False,
                 next_epoch: Callable[[int], list[int]] | None = None) -> None:
        self.indices, self.batch_size, self.epoch = indices, batch_size, epoch
        self.start, self.drop_last, self.next_epoch = start, drop_last, next_epoch
        self.dispatched, self.limit = 0, None
        self.order: collections.deque[tuple[int, int]] = collections.deque()
        self.counts: dict[int, int] = {}
        self.shards = {epoch: indices}
        self.ends = {epoch: start + self._usable(len(indices) - start)}

    def _usable(self, n: int) -> int:
        """How many of ``n`` indices make batches (``drop_last``: whole ones only)."""
        return n - n % self.batch_size if self.drop_last else n

    def dispatched_to(self, epoch: int) -> int:
        """The position in ``epoch``'s indices up to which batches were handed out
        (where the iterator begins in it, when none were)."""
        first = self.start if epoch == self.epoch else 0
        handed = first + self.counts.get(epoch, 0) * self.batch_size
        return min(handed, self.ends.get(epoch, first))

    def forget(self, before: int) -> None:
        """Drop what is kept of the epochs before ``before``."""
        for kept in (self.counts, self.shards, self.ends):
            for e in [e for e in kept if e < before]:
                del kept[e]

    def __iter__(self) -> Iterator[list[int]]:
        epoch, indices, start = self.epoch, self.indices, self.start
        while True:
            end = self.ends[epoch]
            if end <= start:
                return
            for i in range(start, end, self.batch_size):
                if self.limit is not None and self.dispatched >= self.limit:
                    return
                batch = indices[i:min(i + self.batch_size, end)]
                self.dispatched += 1
                self.counts[epoch] = self.counts.get(epoch, 0) + 1
                self.order.append((epoch, len(batch)))
                yield batch
            if self.next_epoch is None:
                return
            epoch, indices, start = epoch + 1, self.next_epoch(epoch + 1), 0
            self.shards[epoch], self.ends[epoch] = indices, self._usable(len(indices))

    def taken(self) -> tuple[int, int]:
        """``(epoch, samples)`` of the next batch the loader yields (call once per
        batch, in order)."""
        return self.order.popleft()


def splittable(batch: Any) -> bool:
    """Whether ``batch`` is tensors with one dim-0 size, possibly nested in plain
    tuples, namedtuples, lists, dicts or OrderedDicts (other containers, whose
    constructors may take other arguments, are not re-cut)."""
    import collections

    import torch

    sizes: set[int] = set()

    def walk(x: Any) -> bool:
        if isinstance(x, torch.Tensor):
            if x.dim() == 0:
                return False
            sizes.add(int(x.shape[0]))
            return True
        if type(x) in (dict, collections.OrderedDict):
            return bool(x) and all(walk(v) for v in x.values())
        if type(x) in (tuple, list) or (isinstance(x, tuple) and hasattr(x, "_fields")):
            return bool(x) and all(walk(v) for v in x)
        return False

    return walk(batch) and len(sizes) == 1


def shut_down(it: Any, background: bool = False) -> None:
    """Stop a ``DataLoader`` iterator's worker processes (nothing for one without
    workers); ``background``: in a daemon thread, since joining a worker waits for the
    batch it is loading."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is None:
        return
    if background:
        threading.Thread(target=shutdown, name="dlrover-loader-handover", daemon=True).start()
    else:
        shutdown()


def _rebuild(like: Any, parts: Any) -> Any:
    if isinstance(like, dict):
        return type(like)(parts)
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a namedtuple
        return type(like)(*parts)
    return type(like)(parts)


def _cat(batches: list[Any]) -> Any:
    import torch

    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches, dim=0)
    if isinstance(first, dict):
        return _rebuild(first, {k: _cat([b[k] for b in batches]) for k in first})
    return _rebuild(first, [_cat([b[i] for b in batches]) for i in range(len(first))])


def _narrow(batch: Any, start: int, length: int) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch[start:start + length]
    if isinstance(batch, dict):
        return _rebuild(batch, {k: _narrow(v, start, length) for k, v in batch.items()})
    return _rebuild(batch, [_narrow(v, start, length) for v in batch])


class Handover:
    """The first ``samples`` samples an old iterator was asked for, served as batches of
    ``batch_size`` (the old batches themselves when their size is ``batch_size``).

    Args:
        it: the old ``DataLoader`` iterator; no more indices may be dispatched to it.
        old_batch_size: samples per batch it yields (the last one may hold fewer only
            when ``old_batch_size == batch_size``).
        batch_size: samples per batch to serve.
        samples: how many to serve: a multiple of both sizes when they differ.
    """

    def __init__(self, it: Iterator, old_batch_size: int, batch_size: int,
                 samples: int) -> None:
        self._it: Iterator | None = it
        self.old_batch_size, self.batch_size = old_batch_size, batch_size
        self.remaining = samples
        self._pieces: list[tuple[Any, int, int]] = []  # (batch, start, length)

    def next(self) -> tuple[Any, int]:
        """``(batch, samples in it)``; the old iterator is shut down after the last."""
        if self.old_batch_size == self.batch_size:
            batch = next(self._it)  # type: ignore[arg-type]
            n = min(self.batch_size, self.remaining)
        else:
            n = self.batch_size
            while sum(p[2] for p in self._pieces) < n:
                self._pieces.append((next(self._it), 0, self.old_batch_size))  # type: ignore
            batch = self._take(n)
        self.remaining -= n
        if self.remaining <= 0:
            self.close()
        return batch, n

    def _take(self, n: int) -> Any:
        parts, need = [], n
        while need:
            b, start, length = self._pieces[0]
            used = min(need, length)
            parts.append(b if (start, used) == (0, self.old_batch_size)
                         else _narrow(b, start, used))
            need -= used
            if used == length:
                self._pieces.pop(0)
            else:
                self._pieces[0] = (b, start + used, length - used)
        return parts[0] if len(parts) == 1 else _cat(parts)

    def close(self) -> None:
        """Stop the old iterator's workers, in the background: the batches they may
        still be loading are not needed."""
        it, self._it, self._pieces = self._it, None, []
        shut_down(it, background=True)
