"""``ElasticDataLoader``: a ``torch.utils.data.DataLoader`` whose ``batch_size``,
``num_workers`` and ``pin_memory`` can change between steps without losing or repeating
a sample of the epoch, and whose position is part of the checkpoint.

How the position is kept: every epoch has one permutation of the dataset's indices
(seeded by ``(seed, epoch)``, the same on every rank). The ranks consume it in
lock-step: rank ``r`` of ``W`` takes positions ``r, r+W, r+2W, ...`` of what is left,
so after each rank consumed ``k`` samples the first ``k*W`` entries of the
permutation are done (``global_position``). A change of settings stops the current
``DataLoader`` iterator from taking more indices; the batches it had already dispatched
to its workers are served first (re-cut to a new ``batch_size``: ``handover.py``) while
a new iterator starts after them. An iterator goes on from one epoch into the next
(its batch sampler chains the epochs' permutations: ``IndexBatches``), so that its
workers load the next epoch's first batches while the tail is served, and are not
stopped and started again at each epoch. A different ``world_size`` after a
restart re-deals the rest of the epoch over the new ranks. Every rank must change
``batch_size`` at the same step boundary (the tuning session guarantees it), and the
tail of an epoch that does not divide by ``world_size`` is skipped (as
``DistributedSampler(drop_last=True)``) so that ranks stay in step.
"""

from __future__ import annotations

import functools
from math import lcm
from typing import TYPE_CHECKING, Any, Callable, Iterator

from dlrover_core.tuning.handover import Handover, IndexBatches, shut_down, splittable

if TYPE_CHECKING:
    from dlrover_core.tuning.metrics import StepTimer

STATE_VERSION = 1


class ElasticDataLoader:
    """A re-configurable loader over a map-style dataset (``__len__`` and ``__getitem__``).

    Args:
        dataset: map-style dataset of ``len(dataset)`` samples.
        batch_size: samples per micro-batch on this rank.
        num_workers, pin_memory, collate_fn, prefetch_factor, timeout,
            multiprocessing_context: as ``torch.utils.data.DataLoader``.
        shuffle: a new permutation per epoch (``False``: index order).
        seed: permutation seed; must be the same on every rank.
        rank, world_size: this rank among the data-parallel ranks.
        drop_last: drop an epoch's last micro-batch when it is smaller than ``batch_size``.
        shards: a :class:`dlrover_core.runtime.sharding.ShardSampler` (dynamic data
            sharding): batches come from the shards it leases from the JobMaster, in the
            main process (``num_workers`` unused), and the position is the shard
            service's: :meth:`state_dict` holds the sampler's shard state (then it is a
            collective: call it on every rank), :meth:`load_state_dict` hands it back;
            after a load call ``shards.restore(step)``, and report each step with
            ``shards.step_done(step)``; :meth:`next_batch` raises ``StopIteration``
            when no shard is left.
    Raises:
        ValueError: a bad argument (named), or a dataset smaller than ``world_size``.
    """

    def __init__(self, dataset: Any, batch_size: int, num_workers: int = 0,
                 pin_memory: bool = False, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False,
                 collate_fn: Callable | None = None, prefetch_factor: int | None = None,
                 timeout: float = 0, multiprocessing_context: Any = None,
                 shards: Any = None) -> None:
        self.shards = shards
        n = len(dataset)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} / world_size {world_size} is invalid; "
                             "allowed: 0 <= rank < world_size")
        if n < world_size:
            raise ValueError(f"the dataset has {n} samples, fewer than world_size={world_size}")
        _check_settings(batch_size, num_workers)
        self.dataset = dataset
        self.batch_size, self.num_workers, self.pin_memory = batch_size, num_workers, pin_memory
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.drop_last = drop_last
        self.collate_fn, self.prefetch_factor, self.timeout = collate_fn, prefetch_factor, timeout
        self.multiprocessing_context = multiprocessing_context
        self.epoch = 0
        self._base = 0           # global position where the current shard starts
        self._offset = 0         # samples of this rank's shard handed out
        self._shard: list[int] | None = None
        self._it: Iterator | None = None
        self._sampler: IndexBatches | None = None
        self._splittable: bool | None = None  # the current iterator's first batch
        self._handover: Handover | None = None
        self.handed_over = 0     # samples served from an old iterator after a change
        self._first_wave = 0     # batches of the new workers' first wave still to serve
        self.rebuilds = 0        # iterators created (1 + one per change)

    # ------------------------------------------------------------------ position
    @property
    def global_position(self) -> int:
        """Entries of this epoch's permutation consumed by all ranks together."""
        return self._base + self._offset * self.world_size

    @property
    def position(self) -> int:
        """Samples this rank consumed in the current epoch."""
        return self._offset

    def __len__(self) -> int:
        """Samples per rank per epoch (after the tail that does not divide by world_size)."""
        return len(self.dataset) // self.world_size

    def _shard_for(self, epoch: int, base: int) -> list[int]:
        """This rank's indices of ``epoch``'s permutation from ``base`` on."""
        return epoch_shard(len(self.dataset), self.seed, self.shuffle, self.rank,
                           self.world_size, epoch, base)

    def _ensure_shard(self) -> list[int]:
        if self._shard is None:
            self._shard = self._shard_for(self.epoch, self._base)
        return self._shard

    def position_marker(self) -> tuple[int, int, int]:
        """Where the loader is: ``(epoch, shard start, samples handed out)``, for
        :meth:`rewind`."""
        return (self.epoch, self._base, self._offset)

    def rewind(self, marker: tuple[int, int, int]) -> None:
        """Go back to ``marker`` (from :meth:`position_marker` on this rank, at a step
        start): the batches handed out since are served again, so a step that was
        rolled back (out of memory) skips no sample. Drops the current iterator."""
        epoch, base, offset = marker
        self._drop_iterator()
        self._first_wave = self.num_workers  # a new iterator: its first wave
        if epoch != self.epoch or base != self._base:
            self._shard = None
        self.epoch, self._base, self._offset = int(epoch), int(base), int(offset)

    # ------------------------------------------------------------------ settings
    def reconfigure(self, batch_size: int | None = None, num_workers: int | None = None,
                    pin_memory: bool | None = None) -> bool:
        """Change settings from the next batch on. Returns ``True`` when anything changed.

        The batches the old iterator had dispatched are served first (a
        :class:`~dlrover_core.tuning.handover.Handover`) while a new iterator, started
        after them at once, loads. With a new ``batch_size`` they are re-cut to it when
        they are tensors (:func:`~dlrover_core.tuning.handover.splittable`) and make whole
        batches of both sizes; the rest is loaded again, never skipped. Call it on every
        rank at the same step boundary.

        Raises:
            ValueError: ``batch_size < 1`` or ``num_workers < 0``.
        """
        new = (batch_size if batch_size is not None else self.batch_size,
               num_workers if num_workers is not None else self.num_workers,
               pin_memory if pin_memory is not None else self.pin_memory)
        _check_settings(new[0], new[1])
        if new == (self.batch_size, self.num_workers, self.pin_memory):
            return False
        old_batch_size = self.batch_size
        self.batch_size, self.num_workers, self.pin_memory = new
        self._hand_over(old_batch_size)
        self._first_wave = self.num_workers
        return True

    @property
    def refilling(self) -> bool:
        """Whether the next batch is part of a change's one-time transition: handed over
        by the old iterator, or one of the first ``num_workers`` batches of the new one
        (its workers start together). The tuning controller does not measure the steps
        that take them (``loader_refill`` in :mod:`dlrover_core.tuning.metrics`)."""
        return self.shards is None and (self._handover is not None or self._first_wave > 0)

    def _hand_over(self, old_batch_size: int) -> None:
        it, sampler = self._it, self._sampler
        if it is None or sampler is None or self._handover is not None:
            self._drop_iterator()  # a change during a handover: reload from the position
            return
        sampler.limit = sampler.dispatched  # what it dispatched of later epochs is dropped
        loaded = sampler.dispatched_to(self.epoch) - self._offset
        if old_batch_size != self.batch_size:
            whole = loaded - loaded % old_batch_size if self._splittable else 0
            loaded = whole - whole % lcm(old_batch_size, self.batch_size)
        self._it = None
        if loaded <= 0:
            shut_down(it)
            return
        self._handover = Handover(it, old_batch_size, self.batch_size, loaded)
        self.handed_over += loaded
        start = self._offset + loaded
        if self._remaining(start) > 0:
            self._it = self._new_iterator(start)
        else:  # the handover ends the epoch: the next one loads meanwhile
            self._it = self._new_iterator(0, self.epoch + 1)

    def _drop_iterator(self) -> None:
        it, self._it, self._sampler = self._it, None, None
        shut_down(it)
        handover, self._handover = self._handover, None
        if handover is not None:
            handover.close()

    def _new_iterator(self, start: int | None = None, epoch: int | None = None) -> Iterator:
        """An iterator from position ``start`` of ``epoch`` (the current one by default)
        on, through the epochs after it."""
        start = self._offset if start is None else start
        epoch = self.epoch if epoch is None else epoch
        shard = self._ensure_shard() if epoch == self.epoch else self._shard_for(epoch, 0)
        it, self._sampler = self._make_iterator(shard, start, epoch)
        self._splittable = None
        return it

    def _make_iterator(self, shard: list[int], start: int,
                       epoch: int) -> tuple[Iterator, IndexBatches]:
        from torch.utils.data import DataLoader

        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            if self.prefetch_factor is not None:
                kwargs["prefetch_factor"] = self.prefetch_factor
            if self.multiprocessing_context is not None:
                kwargs["multiprocessing_context"] = self.multiprocessing_context
            kwargs["timeout"] = self.timeout
        sampler = IndexBatches(shard, self.batch_size, epoch=epoch, start=start,
                               drop_last=self.drop_last,
                               next_epoch=functools.partial(  # no reference to self
                                   epoch_shard, len(self.dataset), self.seed, self.shuffle,
                                   self.rank, self.world_size, base=0))
        loader = DataLoader(self.dataset, batch_sampler=sampler,
                            num_workers=self.num_workers, pin_memory=self.pin_memory,
                            collate_fn=self.collate_fn, **kwargs)
        self.rebuilds += 1
        return iter(loader), sampler

    # ------------------------------------------------------------------ iteration
    def prefetch_depth(self) -> int | None:
        """Batches loaded and waiting in the current iterator's queue (``None`` without
        loader worker processes). Reads the iterator's internal queue: a measurement,
        never used for correctness."""
        it = self._it
        if it is None or self.num_workers == 0:
            return None
        try:
            ready = sum(1 for v in it._task_info.values() if len(v) == 2)  # noqa: SLF001
            return ready + it._data_queue.qsize()  # noqa: SLF001
        except (AttributeError, NotImplementedError):
            return None

    def prefetch_capacity(self) -> int | None:
        """Batches the current iterator's queue holds at most: ``num_workers *
        prefetch_factor`` (PyTorch's default ``prefetch_factor`` is 2); ``None`` without
        loader worker processes."""
        if self.num_workers == 0:
            return None
        return self.num_workers * (self.prefetch_factor or 2)

    def next_batch(self, timer: StepTimer | None = None) -> Any:
        """The next micro-batch; a finished epoch rolls over into the next one.
        With ``timer``, the wait is charged to its ``data`` phase and the queue depth
        and its share of the queue's capacity recorded."""
        if timer is None:
            return self._next()
        with timer.phase("data"):  # starts the step first when it is its first phase
            timer.note_prefetch_depth(self.prefetch_depth(), self.prefetch_capacity())
            timer.note_refill(self.refilling)
            return self._next()

    def _next(self) -> Any:
        if self.shards is not None:
            return self._next_from_shards()
        if self._handover is not None:
            batch, n = self._handover.next()
            self._offset += n
            if self._handover.remaining <= 0:
                self._handover = None
            return batch
        for _ in range(2):
            if self._it is None:
                if self._remaining() <= 0:
                    self._next_epoch()
                    continue
                self._it = self._new_iterator()
            try:
                batch = next(self._it)
            except StopIteration:  # the chain ended at an epoch without a batch
                self._drop_iterator()
                self._next_epoch()
                continue
            epoch, n = self._sampler.taken()  # type: ignore[union-attr]
            while self.epoch < epoch:  # the iterator went on into the next epoch
                self._next_epoch()
            self._offset += n
            self._first_wave = max(0, self._first_wave - 1)
            if self._splittable is None:
                self._splittable = splittable(batch)
            return batch
        raise RuntimeError("the dataset yields no batch (is batch_size larger than an "
                           "epoch with drop_last=True?)")

    def _next_from_shards(self) -> Any:
        from torch.utils.data import default_collate

        self.shards.batch_size = self.batch_size  # a tuner may have changed it
        idx = self.shards.next_indices()
        if idx is None:
            raise StopIteration("the shard service has no shard left")
        return (self.collate_fn or default_collate)([self.dataset[i] for i in idx])

    def _next_epoch(self) -> None:
        """Roll over into the next epoch (the current iterator, if any, goes on into it)."""
        self.epoch += 1
        self._base, self._offset, self._shard = 0, 0, None
        sampler = self._sampler
        if sampler is not None:
            sampler.forget(before=self.epoch)
            self._shard = sampler.shards.get(self.epoch)  # None: not there yet

    def _remaining(self, start: int | None = None) -> int:
        remaining = len(self._ensure_shard()) - (self._offset if start is None else start)
        if self.drop_last:
            remaining -= remaining % self.batch_size
        return remaining

    def epoch_iter(self, timer: StepTimer | None = None) -> Iterator[Any]:
        """Yield the batches left in the current epoch (all of the next one when the
        current one is used up), then stop."""
        if self._remaining() <= 0:
            self._next_epoch()
        epoch = self.epoch
        while self.epoch == epoch and self._remaining() > 0:
            yield self.next_batch(timer)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """``epoch``, ``global_position``, ``seed``, ``dataset_len``, ``world_size`` and
        the current settings; a plain dict of ints/bools (put it in the checkpoint's
        ``extra``); with ``shards``, also ``shards``: the sampler's shard state."""
        return {"state_version": STATE_VERSION, "epoch": self.epoch,
                "global_position": self.global_position, "seed": self.seed,
                "shuffle": self.shuffle, "dataset_len": len(self.dataset),
                "world_size": self.world_size, "batch_size": self.batch_size,
                "num_workers": self.num_workers, "pin_memory": self.pin_memory,
                **({"shards": self.shards.state_dict()} if self.shards is not None else {})}

    def load_state_dict(self, state: dict, settings: bool = False) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, possibly of another
        world size). ``settings=True`` also takes its batch_size/num_workers/pin_memory.

        Raises:
            ValueError: the state is of another dataset length, seed or shuffle mode,
                or its position is outside the epoch.
        """
        for key, mine in (("dataset_len", len(self.dataset)), ("seed", self.seed),
                          ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                raise ValueError(f"loader state {key}={state.get(key)!r} does not match this "
                                 f"loader's {key}={mine!r}; allowed: the same dataset and seed")
        pos = int(state["global_position"])
        if not 0 <= pos <= len(self.dataset):
            raise ValueError(f"loader state global_position={pos} is outside 0..{len(self.dataset)}")
        self._drop_iterator()
        self.epoch = int(state["epoch"])
        self._base, self._offset, self._shard = pos, 0, None
        if self.shards is not None and "shards" in state:
            self.shards.load_state_dict(state["shards"])
        if settings:
            self.reconfigure(int(state["batch_size"]), int(state["num_workers"]),
                             bool(state["pin_memory"]))

    def close(self) -> None:
        """Stop the loader worker processes (a new iterator starts on the next batch)."""
        self._drop_iterator()

    def __del__(self) -> None:
        try:
            self._drop_iterator()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def epoch_shard(n: int, seed: int, shuffle: bool, rank: int, world_size: int, epoch: int,
                base: int = 0) -> list[int]:
    """Rank ``rank``'s indices of ``epoch``'s permutation of ``n`` samples (seeded by
    ``seed`` and ``epoch``; index order without ``shuffle``) from position ``base`` on:
    every ``world_size``-th entry, the tail that does not divide by ``world_size``
    left out."""
    import torch

    if shuffle:
        g = torch.Generator().manual_seed(int(seed) * 1_000_003 + epoch)
        rest = torch.randperm(n, generator=g).tolist()[base:]
    else:
        rest = list(range(base, n))
    usable = len(rest) - len(rest) % world_size
    return rest[:usable][rank::world_size]


def _check_settings(batch_size: Any, num_workers: Any) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid; allowed: an integer >= 1")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers={num_workers!r} is invalid; allowed: an integer >= 0")
