"""ElasticDataLoader, TuningConfig, the step timer, gradient accumulation, LR scaling
and the parallelism switches, in one process (real DataLoader worker processes, real
torch; the FSDP2 switch runs on a real gloo group in tests/test_tuning_job.py)."""

from __future__ import annotations

import collections
import time

import pytest
import torch
from torch.utils.data import Dataset

from dlrover_core.tuning import (
    ActivationCheckpointing,
    ElasticDataLoader,
    StepTimer,
    TuningConfig,
    TuningConfigError,
    grad_accum_steps_for,
    scaled_learning_rate,
)
from dlrover_core.tuning.config import ParallelismSettings
from dlrover_core.tuning.parallelism import apply_parallelism


class Ids(Dataset):
    """Sample i is the tensor [i]."""

    def __init__(self, n: int, sleep_s: float = 0.0) -> None:
        self.n, self.sleep_s = n, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.tensor([i])


def ids_of(batch: torch.Tensor) -> list[int]:
    return batch.view(-1).tolist()


# (batch_size, num_workers) for each successive stretch of batches
SCHEDULE = [(4, 0, 3), (8, 2, 2), (3, 1, 4), (5, 2, 100)]


def consume_epoch(loader: ElasticDataLoader) -> list[int]:
    seen: list[int] = []
    epoch = loader.epoch
    for bs, nw, count in SCHEDULE:
        loader.reconfigure(batch_size=bs, num_workers=nw)
        for _ in range(count):
            if loader.epoch != epoch or loader.position >= len(loader):
                return seen
            seen += ids_of(loader.next_batch())
    return seen


def test_batch_size_and_workers_change_mid_epoch_without_loss_or_repeat():
    n, world = 101, 2
    loaders = [ElasticDataLoader(Ids(n), batch_size=4, seed=7, rank=r, world_size=world)
               for r in range(world)]
    seen = [consume_epoch(lo) for lo in loaders]
    counts = collections.Counter(seen[0] + seen[1])
    assert max(counts.values()) == 1, "a sample was repeated"
    assert len(counts) == n - n % world == 100, "a sample was lost"
    assert set(seen[0]).isdisjoint(seen[1])
    assert loaders[0].rebuilds >= len(SCHEDULE)  # every change made a new iterator
    assert seen[0] != sorted(seen[0])  # shuffled
    # the next epoch is another permutation, again complete
    nxt = [ids_of(b) for b in loaders[0].epoch_iter()]
    assert loaders[0].epoch == 1
    assert len(sum(nxt, [])) == 50 and sum(nxt, []) != seen[0]


def test_position_survives_a_checkpoint_and_a_world_size_change():
    n = 64
    a = [ElasticDataLoader(Ids(n), batch_size=4, num_workers=1, seed=3, rank=r, world_size=2)
         for r in range(2)]
    first = []
    for _ in range(3):
        for lo in a:
            first += ids_of(lo.next_batch())
    state = a[0].state_dict()
    assert state["global_position"] == 24 and a[1].state_dict()["global_position"] == 24
    for lo in a:
        lo.close()
    # resume on ONE rank with another batch size: it gets exactly the rest of the epoch
    b = ElasticDataLoader(Ids(n), batch_size=5, seed=3, rank=0, world_size=1)
    b.load_state_dict(state)
    rest = sum((ids_of(x) for x in b.epoch_iter()), [])
    assert sorted(first + rest) == list(range(n))
    with pytest.raises(ValueError, match="seed=3 does not match"):
        ElasticDataLoader(Ids(n), batch_size=5, seed=4).load_state_dict(state)


def test_prefetch_depth_and_data_wait_are_measured():
    loader = ElasticDataLoader(Ids(40, sleep_s=0.01), batch_size=2, num_workers=2, seed=0)
    timer = StepTimer()
    timer.start_step()
    loader.next_batch(timer)
    time.sleep(0.2)  # the workers fill the queue meanwhile
    loader.next_batch(timer)
    with timer.phase("compute"):
        pass
    m = timer.end_step(samples=4)
    assert m["data_wait_s"] > m["compute_s"]
    assert m["prefetch_depth"] > 0  # the second request found ready batches
    # 2 workers x PyTorch's default prefetch_factor 2: a queue of 4 batches
    assert loader.prefetch_capacity() == 4
    assert m["prefetch_fill"] == pytest.approx(m["prefetch_depth"] / 4)
    assert m["samples_per_s"] == pytest.approx(4 / m["step_s"])
    assert m["peak_rss_bytes"] > 10 * 2**20 and m["memory_capacity_bytes"] > m["peak_rss_bytes"]
    assert loader.prefetch_depth() is not None
    loader.reconfigure(num_workers=3)
    assert loader.prefetch_capacity() == 6
    assert ElasticDataLoader(Ids(40), batch_size=2, num_workers=3,
                             prefetch_factor=4).prefetch_capacity() == 12
    loader.reconfigure(num_workers=0)
    assert loader.prefetch_depth() is None and loader.prefetch_capacity() is None
    with pytest.raises(ValueError, match="phase 'io' is unknown"):
        with timer.phase("io"):
            pass
    with pytest.raises(ValueError, match="batch_size=0 is invalid"):
        loader.reconfigure(batch_size=0)


def test_tuning_config_round_trip_and_named_errors():
    cfg = TuningConfig.from_dict({"version": 2, "dataloader": {"batch_size": 8},
                                  "optimizer": {"grad_accum_steps": 4}})
    assert cfg.global_batch(world_size=2) == 64
    again = TuningConfig.from_dict(cfg.to_dict())
    assert again == cfg
    new = cfg.updated({"dataloader": {"num_workers": 3}}, version=3)
    assert new.version == 3 and cfg.diff(new) == {"dataloader": {"num_workers": [0, 3]}}
    with pytest.raises(TuningConfigError, match=r"dataloader\.batch_size: 0 is invalid; "
                                                r"allowed: an integer >= 1"):
        cfg.updated({"dataloader": {"batch_size": 0}})
    with pytest.raises(TuningConfigError, match=r"optimizer\.momentum: unknown key; allowed: "
                                                r"grad_accum_steps, learning_rate"):
        cfg.updated({"optimizer": {"momentum": 0.9}})
    with pytest.raises(TuningConfigError, match="model: unknown TuningConfig section"):
        TuningConfig.from_dict({"model": {}})


def test_learning_rate_rules_and_accumulation():
    assert scaled_learning_rate(0.1, 256, 1024, "linear") == pytest.approx(0.4)
    assert scaled_learning_rate(0.1, 256, 1024, "sqrt") == pytest.approx(0.2)
    assert scaled_learning_rate(0.1, 256, 1024, "none") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="lr_scaling 'cubic' is invalid"):
        scaled_learning_rate(0.1, 1, 2, "cubic")
    assert grad_accum_steps_for(64, 8, 2) == 4
    with pytest.raises(ValueError, match="not a multiple"):
        grad_accum_steps_for(64, 6, 2)


def _grads(micro: int, accum: int, checkpointed: bool = False) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    ac = ActivationCheckpointing([model[0], model[2]], enabled=checkpointed)
    data = torch.randn(micro * accum, 8, generator=torch.Generator().manual_seed(1))
    for i in range(accum):
        x = data[i * micro:(i + 1) * micro]
        (model(x).pow(2).mean() / accum).backward()
    assert ac.recomputed == (2 * accum if checkpointed else 0)
    return [p.grad.clone() for p in model.parameters()]


def test_gradient_accumulation_keeps_the_global_batch_gradient():
    ref = _grads(16, 1)
    for micro, accum in ((8, 2), (4, 4)):
        for a, b in zip(ref, _grads(micro, accum)):
            torch.testing.assert_close(a, b)
    for a, b in zip(ref, _grads(8, 2, checkpointed=True)):  # recompute: same gradient
        torch.testing.assert_close(a, b)


def test_parallelism_switches_refuse_what_the_model_lacks():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs an FSDP2 model"):
        apply_parallelism(ParallelismSettings(reshard_after_forward=True), model)
    with pytest.raises(ValueError, match="register its blocks"):
        apply_parallelism(ParallelismSettings(activation_checkpointing=True), model)
    ac = ActivationCheckpointing([model])
    assert apply_parallelism(ParallelismSettings(activation_checkpointing=True), model, ac) \
        == {"activation_checkpointing": True}
    assert apply_parallelism(ParallelismSettings(activation_checkpointing=True), model, ac) == {}


class CountedIds(Dataset):
    """Sample i is ``{"x": [i], "y": [-i]}``; every read of i is counted in shared memory
    (the loader's worker processes are forked, so they write the same array)."""

    def __init__(self, n: int, sleep_s: float = 0.0) -> None:
        import multiprocessing

        self.n, self.sleep_s = n, sleep_s
        self.reads = multiprocessing.get_context("fork").Array("i", n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        with self.reads.get_lock():
            self.reads[i] += 1
        time.sleep(self.sleep_s)
        return {"x": torch.tensor([i]), "y": torch.tensor([-i])}


@pytest.mark.parametrize("change", [{"num_workers": 4}, {"batch_size": 8},
                                    {"batch_size": 2, "num_workers": 1}])
def test_a_change_serves_the_batches_already_loaded(change):
    """Before the handover, a change dropped the batches the workers had loaded and read
    them again: every sample must be read once, served once, in batches of the size in
    force, and the first batches after the change come from the old workers."""
    n = 108  # 12 served before the change, then 96: whole batches of 2, 4 and 8
    data = CountedIds(n, sleep_s=0.002)
    loader = ElasticDataLoader(data, batch_size=4, num_workers=2, seed=5,
                               multiprocessing_context="fork")
    seen = [ids_of(loader.next_batch()["x"]) for _ in range(3)]
    time.sleep(0.3)  # the 2 workers load their prefetch_factor * 2 = 4 batches ahead
    loader.reconfigure(**change)
    assert loader.handed_over == 16  # 4 loaded batches of 4, whole batches of 8 too
    size = change.get("batch_size", 4)
    while loader.position < 60:  # before the next epoch's workers start reading
        b = loader.next_batch()
        assert ids_of(b["y"]) == [-i for i in ids_of(b["x"])]
        seen.append(ids_of(b["x"]))
    flat = sum(seen, [])
    assert len(set(flat)) == len(flat) == 60
    assert max(data.reads) == 1, "a loaded sample was dropped and read again"
    assert all(data.reads[i] == 1 for i in flat)
    while loader.position < len(loader):
        seen.append(ids_of(loader.next_batch()["x"]))
    assert [len(s) for s in seen[3:]] == [size] * ((n - 12) // size)
    assert sorted(sum(seen, [])) == list(range(n))
    loader.close()


def test_a_handover_keeps_whole_batches_and_reloads_the_rest():
    """Batches that do not re-cut into whole batches of both sizes, and batches that are
    not tensors, are loaded again by the new iterator: none lost, none repeated."""
    n = 200  # the new iterator's first 6 batches of 16 end well before the epoch
    data = CountedIds(n, sleep_s=0.002)
    loader = ElasticDataLoader(data, batch_size=4, num_workers=3, seed=1,
                               multiprocessing_context="fork")
    seen = [ids_of(loader.next_batch()["x"])]
    time.sleep(0.3)  # 3 workers keep prefetch_factor * 3 = 6 batches of 4 loaded ahead
    loader.reconfigure(batch_size=16)  # one whole batch of 16 out of those 24 samples
    assert loader.handed_over == 16
    seen += [ids_of(loader.next_batch()["x"]) for _ in range(2)]
    reread = [i for i in range(n) if data.reads[i] == 2]
    assert len(reread) == 8 and max(data.reads) == 2  # the 2 batches that were not kept
    assert set(reread) <= set(seen[2])  # the new iterator's first batch
    while loader.position < len(loader):
        seen.append(ids_of(loader.next_batch()["x"]))
    assert sorted(sum(seen, [])) == list(range(n))
    assert [len(s) for s in seen[1:]] == [16] * 12 + [4]

    plain = ElasticDataLoader(Ids(20), batch_size=4, num_workers=2, seed=1,
                              collate_fn=lambda xs: [int(x) for x in xs])
    got = [plain.next_batch()]
    time.sleep(0.3)
    plain.reconfigure(batch_size=2)  # a list of ints cannot be re-cut
    assert plain.handed_over == 0
    plain.reconfigure(batch_size=2, num_workers=1)
    got += list(plain.epoch_iter())
    assert sorted(sum(got, [])) == list(range(20))


def test_the_next_epoch_is_loading_before_the_current_one_ends():
    """The iterator goes on into the next epoch once the current epoch's last batch was
    dispatched, so its first batches are read before they are asked for; each sample is
    still read once per epoch, and a change of settings drops them (read again)."""
    n = 40
    data = CountedIds(n, sleep_s=0.002)
    loader = ElasticDataLoader(data, batch_size=4, num_workers=2, shuffle=False,
                               multiprocessing_context="fork")
    first = sum((ids_of(b["x"]) for b in loader.epoch_iter()), [])
    assert first == list(range(n)) and loader.epoch == 0
    time.sleep(0.3)
    assert data.reads[0] == 2 and data.reads[n - 1] == 1  # epoch 1 read ahead
    second = sum((ids_of(b["x"]) for b in loader.epoch_iter()), [])
    assert second == list(range(n)) and loader.epoch == 1
    # epoch 2's first 4 batches are read ahead; no sample was read twice in an epoch
    assert list(data.reads[16:]) == [2] * (n - 16) and max(data.reads) == 3
    time.sleep(0.3)
    assert data.reads[0] == 3  # epoch 2 read ahead, then dropped by a change
    loader.reconfigure(batch_size=8)
    third = sum((ids_of(b["x"]) for b in loader.epoch_iter()), [])
    time.sleep(0.3)
    assert third == list(range(n)) and data.reads[n - 1] == 3
    # sample 0: epochs 0 and 1, the dropped read-ahead, epoch 2, epoch 3's read-ahead
    assert data.reads[0] == 5
    loader.close()


class WorkerPids(Dataset):
    """Sample i is ``[i, pid of the process that read it]``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        import os

        return torch.tensor([i, os.getpid()])


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_same_worker_processes_serve_epoch_after_epoch(drop_last):
    """One iterator and its workers go on from epoch to epoch (no workers stopped and
    started at an epoch's end: a stall of every step that waits on them); each epoch is
    still its own permutation, whole, its short last batch served alone (or dropped)."""
    n, bs = 42, 4  # 10 whole batches per epoch and one of 2
    loader = ElasticDataLoader(WorkerPids(n), batch_size=bs, num_workers=2, seed=7,
                               drop_last=drop_last, multiprocessing_context="fork")
    epochs: dict[int, list[list[int]]] = collections.defaultdict(list)
    pids: set[int] = set()
    per_epoch = 10 if drop_last else 11
    for _ in range(3 * per_epoch):
        epoch = loader.epoch if loader.position < len(loader) - (2 if drop_last else 0) \
            else loader.epoch + 1
        batch = loader.next_batch()
        assert loader.epoch == epoch  # the position rolls over with the batch
        epochs[epoch].append(batch[:, 0].tolist())
        pids |= set(batch[:, 1].tolist())
    assert sorted(epochs) == [0, 1, 2] and loader.rebuilds == 1 and len(pids) == 2
    for e, batches in epochs.items():
        assert [len(b) for b in batches] == [bs] * 10 + ([] if drop_last else [2])
        ids = sum(batches, [])
        assert len(set(ids)) == len(ids) == (40 if drop_last else n)
        assert loader._shard_for(e, 0)[:len(ids)] == ids  # noqa: SLF001 - epoch e's order
    assert epochs[0] != epochs[1]
    state = loader.state_dict()
    assert (state["epoch"], state["global_position"]) == (2, 40 if drop_last else n)
    loader.close()


def test_a_rewind_across_an_epoch_s_end_serves_the_same_batches_again():
    """A step that took an epoch's last batch and the next epoch's first, then ran out
    of memory, is rewound to its start (``position_marker``/``rewind``): it gets the
    same batches again, and both epochs stay whole."""
    n, bs = 24, 4
    loader = ElasticDataLoader(WorkerPids(n), batch_size=bs, num_workers=2, seed=3,
                               multiprocessing_context="fork")
    first = [loader.next_batch()[:, 0].tolist() for _ in range(5)]
    marker = loader.position_marker()
    step = [loader.next_batch()[:, 0].tolist() for _ in range(2)]  # epoch 0's last, 1's first
    assert loader.epoch == 1 and loader.position == bs
    loader.rewind(marker)
    assert (loader.epoch, loader.position) == (0, 5 * bs)
    again = [loader.next_batch()[:, 0].tolist() for _ in range(2)]
    assert again == step
    rest = [b[:, 0].tolist() for b in loader.epoch_iter()]
    assert sorted(sum(first, []) + again[0]) == list(range(n))
    assert sorted(again[1] + sum(rest, [])) == list(range(n)) and loader.epoch == 1
    loader.close()


def test_a_change_at_the_end_of_an_epoch_starts_the_next_one_with_the_new_settings():
    n = 40
    data = CountedIds(n, sleep_s=0.002)
    loader = ElasticDataLoader(data, batch_size=4, num_workers=2, shuffle=False,
                               multiprocessing_context="fork")
    first = [ids_of(loader.next_batch()["x"]) for _ in range(8)]
    time.sleep(0.3)  # the last 2 batches loaded; epoch 1's first batches too
    loader.reconfigure(batch_size=8)  # drops epoch 1's read-ahead (batches of 4)
    assert loader.handed_over == 8  # the epoch's last 2 batches, as one of 8
    time.sleep(0.3)
    assert data.reads[0] == 3  # epoch 1 read ahead again, in batches of 8
    first.append(ids_of(loader.next_batch()["x"]))
    assert sum(first, []) == list(range(n)) and len(first[-1]) == 8
    second = [ids_of(b["x"]) for b in loader.epoch_iter()]
    assert sum(second, []) == list(range(n)) and {len(b) for b in second} == {8}
    assert loader.epoch == 1 and data.reads[n - 1] == 2
    loader.close()


def test_only_known_containers_of_tensors_are_re_cut():
    import collections

    from dlrover_core.tuning.handover import splittable

    pair = collections.namedtuple("Pair", "x y")
    t = torch.zeros(4, 3)
    assert splittable((t, t)) and splittable([t, {"a": t}]) and splittable(pair(t, t))
    assert splittable(collections.OrderedDict(a=t))
    assert not splittable((t, torch.zeros(2)))  # two batch sizes
    assert not splittable((t, 3)) and not splittable(torch.tensor(1.0))
    assert not splittable(collections.defaultdict(list, a=t))  # its constructor differs


def test_the_steps_of_a_change_s_transition_report_loader_refill():
    """After a change, the steps served by the old workers' batches and by the new
    workers' first wave carry ``loader_refill`` (the tuning controller does not measure
    them); the steps before the change and after the first wave do not."""
    n = 108
    data = CountedIds(n, sleep_s=0.002)
    loader = ElasticDataLoader(data, batch_size=4, num_workers=2, seed=5,
                               multiprocessing_context="fork")
    timer = StepTimer()

    def step() -> float:
        loader.next_batch(timer)
        return timer.end_step(samples=loader.batch_size).get("loader_refill", 0.0)

    before = [step() for _ in range(3)]
    time.sleep(0.3)  # the 2 workers load 4 batches of 4 ahead
    loader.reconfigure(batch_size=8)
    assert loader.handed_over == 16  # two batches of 8
    after = [step() for _ in range(8)]
    # 2 handed-over batches, then the new iterator's first wave of 2 (one per worker)
    assert before == [0.0] * 3 and after == [1.0] * 4 + [0.0] * 4
    time.sleep(0.3)
    loader.reconfigure(num_workers=3)  # 4 batches of 8 handed over, then a wave of 3
    assert loader.handed_over == 16 + 32
    assert [step() for _ in range(8)] == [1.0] * 7 + [0.0]
    loader.close()
