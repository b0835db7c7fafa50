"""Flash checkpoint vs the usual ways to save and load a training state.

For each state size (float32 tensors, 16 of them per state), in one run, one entry
of ``results`` with ``size_mib`` (the size asked for) and:

- ``memcpy_gib_s``: ``Tensor.copy_`` of the state into preallocated tensors: the
  physical bound of a save into memory on this machine;
- ``flash_save_gib_s``: the blocking time of ``FlashSaver.save`` (steady state: both
  shared-memory slots laid out and faulted in; the persister's disk write of the
  previous save is waited for, untimed, so that it does not compete for the cores);
  ``save_over_memcpy``: its ratio to ``memcpy_gib_s``;
- ``torch_save_fsync_gib_s``: ``torch.save`` to a file on local disk + ``fsync``;
- ``dcp_save_gib_s``: ``torch.distributed.checkpoint.save`` (one process) with
  ``sync_files=True``;
- ``load_memory_gib_s``: ``FlashSaver.load`` into a preallocated state by a fresh
  saver (new mappings, as a restarted process has), header checks included;
  ``load_over_memcpy`` its ratio to ``memcpy_gib_s``; ``pread_shm_gib_s``: bare
  ``os.preadv`` calls (32 MiB each, over the reader's threads) of the same bytes from a
  ``/dev/shm`` file into the preallocated state: the kernel's copy out of shared memory,
  the bound of a load that does not map the buffer (``load_over_pread_shm``);
- ``load_warm_gib_s``: ``FlashSaver.load`` of the newest save by the saver that made it
  (its mappings exist, as in a survivor that restores in place) into the same
  preallocated state, header checks included; ``load_warm_vs_memcpy`` its ratio to
  ``memcpy_gib_s``. The first save after such a load starts the saver's new attempt
  (rank 0 writes the lineage file): each round makes that save untimed after the load;
- ``load_standby_gib_s``: ``FlashSaver.load`` by a new saver in a process that ran
  ``FlashSaver.prepare_standby`` first (untimed: a warm standby maps the node's slots
  while it waits), a promoted standby's load; ``load_standby_vs_memcpy`` its ratio to
  ``memcpy_gib_s``;
- ``torch_load_gib_s``: ``torch.load`` of the ``torch.save`` file after its pages were
  dropped from the page cache (``posix_fadvise(DONTNEED)``), i.e. from the disk;
  ``torch_load_warm_gib_s`` is the same from the page cache;
- ``flash_save_first_gib_s``: the first save of a saver whose
  ``load()`` found no checkpoint and reserved the buffers in the background (waited
  for, untimed: the first training steps), median over ``--repeat`` savers (a saver
  has one first save); ``first_over_steady``: the seconds of that first save over
  those of a steady save (``flash_save_gib_s``), in every result, lean ones included
  (> 1: the first save is slower); ``flash_save_unreserved_gib_s``: the first save of a saver
  that reserved nothing; ``reserve_s``: the background reservation (median);
- ``replica_gib_s`` / ``replica_lag_s``: ``replicas: 1``, the persister's copy of a
  save into the peer node's memory (this machine runs two raylets) over its TCP
  connection (``replica_transport: tcp``, the default), and the time from the save's
  return until the replica is complete (the persister's ``wait_replica`` returned, one
  Ray call: nothing polls the persister during the copy); ``replica_over_memcpy``:
  ``replica_gib_s`` / ``memcpy_gib_s``; ``replica_ray_gib_s`` / ``replica_ray_lag_s``: the same through
  Ray's object store (``replica_transport: ray``), the path before the TCP one;
  ``socket_copy_gib_s``: the bound of the TCP path measured in the same run, a bare
  loopback TCP copy of the same bytes into a populated buffer until the receiver
  acknowledges the last byte (:func:`socket_copy_s`), and ``replica_vs_socket``:
  ``replica_gib_s`` over it; ``replica_connect_s`` / ``replica_stream_s``: the TCP
  replica's time split, opening the connection to the holder (0 where the connection
  kept from an earlier replica carried it, as in every steady replica) and from the
  first byte until the holder acknowledged the last (medians);
- ``restore_other_world_size_s``: a state saved by 2 ranks (``Shard(0)`` DTensors,
  gloo, Ray actors) loaded into 1 rank from memory; ``restore_same_world_size_s``: the
  same state saved by 1 rank, loaded by 1 (each the median of ``--repeat`` loads, at
  least 3, by new actors); ``restore_other_over_same``: their ratio.

- ``state_bytes``: the bytes of the state's tensors; ``load_cold_gib_s``: ``load()`` of a
  fresh saver (new mappings) made before, untimed, with what it starts in the
  background at its creation finished (the run id and the node's persister looked up,
  the persister registered: a trainer builds its model and optimizer in between);
  ``load_cold_vs_preadv``: its ratio to ``pread_shm_gib_s`` (until 2026-12-01 this key
  held ``load_over_pread_shm``, the saver's creation included);
  ``load_cold_with_init_vs_preadv``: the same ratio as ``load_over_pread_shm`` (the
  saver made and its load timed back to back, as ``load_memory_gib_s``);
- the probe of each size, a job of its own: a Ray actor that does only what a trainer's
  checkpointing does (builds the state, then ``--repeat`` + 1 saves with a flash saver,
  each persisted and waited for: two slots, one for a lean size) beside a new persister
  process. ``persist_gib_s``: the state's bytes over the persister's own time for one
  save (its history's ``seconds``: the shard written with its crc32 and ``fsync``, then
  the commit, which prunes the older step), median of the saves after the first;
  ``persist_write_gib_s``: the same saves until the files were written and fsynced
  (the history's ``write_seconds``: no commit); ``write_fsync_gib_s``: a bare
  sequential ``write`` of the same bytes from the trainer's tensors into a new file in
  the same checkpoint directory, then ``fsync``, after each of those saves (median);
  ``persist_vs_write_fsync`` and ``persist_write_vs_write_fsync``: the ratios of
  ``persist_gib_s`` and of ``persist_write_gib_s`` to it; ``crc32_gib_s``: ``zlib.crc32``
  of the same bytes in the persister's 8 MiB pieces, one pass on one core, as many
  times as those saves, after them (median): the persister's checksum, which runs
  beside its write;
- ``peak_rss_trainer_bytes`` / ``peak_rss_persister_bytes``: the kernel's ``VmHWM``
  (peak resident set, ``/proc/<pid>/status``) of the probe's trainer process and of its
  persister process over their lives: it counts the interpreter, torch and Ray (the
  process's start, ``rss_detail.trainer_base_bytes`` / ``persister_base_bytes``) and
  every page of a shared-memory slot the process touched (the trainer writes every
  slot, the persister reads them), as Linux counts mapped shared pages in the resident
  set. ``rss_detail`` splits them, sampled every 10 ms from the same file: the peak
  of ``RssAnon`` (private memory) and of ``RssShmem`` (the mapped slot pages) of each
  (``trainer_peak_anon_bytes``, ``trainer_peak_shmem_bytes``,
  ``persister_peak_anon_bytes``, ``persister_peak_shmem_bytes``),
  and ``trainer_extra_anon_bytes`` (peak private memory less the start's and less the
  state itself) and ``persister_extra_anon_bytes`` (peak private memory less the
  start's): what a save or a persist allocates beyond the slots, i.e. any second copy.

Sizes above ``--full-max-mib`` (default 1024) run lean, so that a state of 6 GiB fits a
machine of 24 GiB (the state and one slot of it in memory at a time): ``lean: true`` in
their figures, and ``None`` for ``flash_save_unreserved_gib_s``,
``torch_save_fsync_gib_s``, ``torch_load_gib_s``, ``torch_load_warm_gib_s``,
``load_over_torch_load``, ``dcp_save_gib_s`` (a second copy or more time: a torch.load
makes a new state) and the ``replica_*`` and ``restore_*`` figures (peer buffers, a state
per actor); ``flash_save_first_gib_s`` from one saver, and the memcpy bound through a
reused destination of 256 MiB (see :func:`bench_cpu`). ``probe_slots``: the slots of
the probe's saver (2; 1 at a lean size).

The figures of :func:`bench_cpu` are taken in a Ray actor of their own per size
(:class:`CpuBench`), killed after it, so that no size's memory stays for the next.

Each figure is the median of ``--repeat`` runs (at least 5 for the in-memory ones,
which are interleaved: one memcpy, one save, one load per round). With a CUDA GPU the state is also
measured GPU-resident (``gpu`` list: device-to-pinned-host copy bound, flash save,
load back into GPU tensors). The last line of output is one JSON object.

``--gpu-d2h`` (CUDA only, no Ray; ``make gpu-check`` runs it) measures only the D2H
of a GPU-resident state into a shared-memory segment: ``pinned_shm_d2h_gib_s``, the
save's first choice (the segment page-locked, one DMA per tensor), and
``staged_d2h_gib_s``, its fallback when the segment cannot be page-locked (the staging
copy, :mod:`dlrover_plugin_flashckpt.staging`), against ``to_cpu_non_blocking_gib_s``,
a plain ``tensor.to("cpu", non_blocking=True)`` of the same tensors into pinned memory.

    .venv/bin/python benchmarks/flash_checkpoint.py [--sizes-mib 256,1024] [--repeat 3]
        [--full-max-mib 1024]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch

GIB = float(1 << 30)
N_TENSORS = 16
#: lean sizes: the memcpy bound copies the state through one destination of this many MiB
LEAN_MEMCPY_MIB = 256


def make_state(size_mib: int, device: str = "cpu") -> dict:
    n = (size_mib << 20) // 4 // N_TENSORS
    g = torch.Generator().manual_seed(size_mib)
    return {"model": {f"layer{i}.weight": torch.randn(n, generator=g).to(device)
                      for i in range(N_TENSORS)},
            "extra": {"step": 0}}


def like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "extra": {"step": -1}}


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def median_s(fn: Callable[[], Any], repeat: int, before: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def gpu_state(size_mib: int) -> tuple[dict, float, dict[str, Any]]:
    """A GPU-resident state of ``size_mib`` MiB, its size in GiB and the start of its
    figures (``size_mib``, ``device``)."""
    state = make_state(size_mib, "cuda")
    return state, nbytes(state) / GIB, {"size_mib": size_mib,
                                        "device": torch.cuda.get_device_name()}


def pinned_d2h_s(state: dict, repeat: int) -> float:
    """Seconds (median) to copy the GPU-resident ``state`` into preallocated pinned host
    tensors: one ``copy_(non_blocking=True)`` per tensor (what
    ``tensor.to("cpu", non_blocking=True)`` does into pinned memory), then
    ``torch.cuda.synchronize()``."""
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
              for k, v in state["model"].items()}

    def d2h() -> None:
        for k, v in state["model"].items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()

    d2h()
    return median_s(d2h, repeat)


def copy_all(views: list, sources: list, non_blocking: bool) -> None:
    """``copy_`` each source tensor into its view (the save's copy), then wait for the
    GPU (``torch.cuda.synchronize()``)."""
    for dst, src in zip(views, sources):
        dst.copy_(src, non_blocking=non_blocking)
    torch.cuda.synchronize()


def shm_slot(state: dict, tag: str, size_mib: int) -> tuple:
    """A shared-memory segment laid out for ``state`` as the saver lays out a slot
    (``/dev/shm/<prefix><tag>-<pid>-<size_mib>``): ``(seg, table, sources, skeleton,
    views)``, one tensor view into the segment per table entry. The caller drops every
    view, then closes ``seg`` and unlinks ``seg.path``."""
    from dlrover_plugin_flashckpt import layout, shm

    table, sources, skeleton = layout.build_table(state)
    path = f"/dev/shm/{shm.NAME_PREFIX}{tag}-{os.getpid()}-{size_mib}"
    seg = shm.Segment.create(path, 4096, layout.data_size(table), {"job": "gpubench"},
                             layout.signature(table), 0, 1)
    h = seg.read_header()
    return seg, table, sources, skeleton, [layout.tensor_view(seg.mm, h.data_offset, e)
                                           for e in table]


def flash_saver(job: str, directory: str, **options: Any):
    """A saver of its own role (the persister tracks ranks by role and rank; one role
    per checkpoint directory, as in a job)."""
    from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
    from dlrover_plugin_flashckpt.saver import FlashSaver

    return FlashSaver(SaverConfig(dir=directory, keep=1, job=job, options=options),
                      SaverContext(role=os.path.basename(directory)))


class FlashRounds:
    """A flash saver of ``ckpt`` and the calls the CPU and GPU figures time: :meth:`save`
    (``state`` as the next step), :meth:`load` (that step, by a fresh saver from
    memory into :attr:`template`, checked) and :meth:`unmap` (untimed: a restarted
    trainer keeps the mappings for its saves; here the fresh savers close theirs).
    ``sync``: called at the end of each load (a GPU's ``torch.cuda.synchronize``)."""

    def __init__(self, job: str, ckpt: str, state: dict,
                 sync: Callable[[], Any] | None = None, **options: Any) -> None:
        self.job, self.ckpt, self.state, self.sync = job, ckpt, state, sync
        self.options = options
        self.saver = flash_saver(job, ckpt, **options)
        self.step = 0
        self.template = like(state)
        self.fresh: list = []

    def save(self) -> None:
        self.step += 1
        self.saver.save(self.step, self.state)

    def load(self) -> None:
        # new mappings, as a restart; the saver made and its load back to back
        self.fresh.append(flash_saver(self.job, self.ckpt, **self.options))
        self.load_made()

    def make_saver(self) -> None:
        """Untimed: a new saver (new mappings, as a restarted process makes at its setup),
        with what it starts in its background thread (the run id and the node's
        persister looked up, the persister registered) finished (``persister()``), as in
        a trainer that builds its model and optimizer between ``Checkpointer.for_worker``
        and ``load``."""
        self.fresh.append(flash_saver(self.job, self.ckpt, **self.options))
        self.fresh[-1].persister()

    def load_made(self) -> None:
        """The load of the newest saver :attr:`fresh` holds, into :attr:`template`."""
        got = self.fresh[-1].load(self.template)
        assert got == self.step and self.fresh[-1].last_load_source == "memory", got
        if self.sync is not None:
            self.sync()

    def load_warm(self) -> None:
        """A load by :attr:`saver` itself (the saver that made the save: its mappings
        exist, as in a survivor that restores in place), into :attr:`template`."""
        got = self.saver.load(self.template)
        assert got == self.step and self.saver.last_load_source == "memory", got
        if self.sync is not None:
            self.sync()

    def premap(self) -> None:
        """Untimed: what a warm standby does while it waits (the saver's
        ``prepare_standby``: this node's slots of the role mapped, page tables filled)."""
        from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
        from dlrover_plugin_flashckpt.saver import FlashSaver

        FlashSaver.prepare_standby(SaverConfig(dir=self.ckpt, job=self.job,
                                               options=self.options), SaverContext())

    def load_standby(self) -> None:
        """A load by a new saver after :meth:`premap` (a promoted standby: its saver
        takes the premapped slots), into :attr:`template`; it must copy from them."""
        self.fresh.append(flash_saver(self.job, self.ckpt, **self.options))
        got = self.fresh[-1].load(self.template)
        assert got == self.step and self.fresh[-1].last_load_source == "memory", got
        assert self.fresh[-1].loader.last_memory_read == "mapping"
        if self.sync is not None:
            self.sync()

    def unmap(self) -> None:
        while self.fresh:
            self.fresh.pop().close()


def bench_cpu(size_mib: int, work: str, repeat: int, job: str, lean: bool = False) -> dict:
    """The CPU figures of one size. The in-memory ones (memcpy, flash save, flash load)
    are taken interleaved, one of each per round, so that a change of load on a shared
    machine hits them alike.

    ``lean`` (a size above ``--full-max-mib``): no second copy of the state beside the
    saver's one slot, which does not persist during the rounds (``persist_every_steps``
    out of reach; its newest save is persisted once, untimed, before it closes). Loads
    and the preadv bound write into the state's own tensors (a restarted trainer's),
    the bound reads the saver's slot file, and memcpy copies the state through one
    preallocated destination of :data:`LEAN_MEMCPY_MIB` MiB, reused (still far beyond
    the caches: a copy from and to memory). The figures that need more copies or savers are
    ``None``: ``flash_save_unreserved_gib_s``, ``torch_save_fsync_gib_s``,
    ``torch_load_gib_s``, ``torch_load_warm_gib_s``, ``load_over_torch_load``,
    ``dcp_save_gib_s``; ``flash_save_first_gib_s`` and ``reserve_s`` come from one
    saver, not ``repeat``."""
    import torch.distributed.checkpoint as dcp

    from dlrover_plugin_flashckpt import shm

    state = make_state(size_mib)
    gib = nbytes(state) / GIB
    out: dict[str, Any] = {"size_mib": size_mib, "state_bytes": nbytes(state), "lean": lean}

    ckpt = os.path.join(work, f"flash{size_mib}")
    options: dict[str, Any] = {"slots": 1, "persist_every_steps": 10**9} if lean else {}
    flash = FlashRounds(job, ckpt, state, **options)
    saver = flash.saver
    if lean:  # loads and preadv go into the state itself (a restarted trainer's own tensors)
        flash.template = dst = state
        chunk = torch.empty(LEAN_MEMCPY_MIB << 18)  # float32: LEAN_MEMCPY_MIB MiB

        def memcpy() -> None:
            for v in state["model"].values():
                flat = v.view(-1)
                for o in range(0, flat.numel(), chunk.numel()):
                    part = flat[o:o + chunk.numel()]
                    chunk[:part.numel()].copy_(part)
    else:
        dst = like(state)

        def memcpy() -> None:
            for k, v in state["model"].items():
                dst["model"][k].copy_(v)

    # the kernel's copy out of shared memory without mapping it, as a load reads: the
    # same bytes in a /dev/shm file, os.preadv of 32 MiB per call over the reader's threads
    # (lean: the saver's slot file, from its data offset, once the first save is in it)
    from dlrover_plugin_flashckpt.reader import CHUNK, read_pool

    bound_path, bound_offset = f"/dev/shm/flashbench-pread-{os.getpid()}-{size_mib}", 0
    if not lean:
        with open(bound_path, "wb") as f:
            for v in state["model"].values():
                f.write(memoryview(v.numpy()).cast("B"))
    pool = read_pool()
    bound: list[int] = []

    def pread_shm() -> None:
        parts, pos = [], bound_offset
        for v in dst["model"].values():
            n = v.numel() * v.element_size()
            parts += [(v.data_ptr() + o, min(CHUNK, n - o), pos + o) for o in range(0, n, CHUNK)]
            pos += n
        for f in [pool.submit(lambda a, n, o: os.preadv(
                bound[0], [(ctypes.c_char * n).from_address(a)], o), *p) for p in parts]:
            assert f.result() > 0

    memcpy()  # fault the destination in
    if not lean:
        # the first save of a saver that reserved nothing: it lays out its buffer itself
        # (one slot, so that the figure is one allocation)
        cold = flash_saver(job, ckpt + "-cold", slots=1)
        out["flash_save_unreserved_gib_s"] = gib / median_s(lambda: cold.save(1, state), 1)
        cold.wait()
        paths = list(cold.paths)
        cold.close()
        for p in paths:
            os.unlink(p)
        shutil.rmtree(ckpt + "-cold", ignore_errors=True)
    else:
        out["flash_save_unreserved_gib_s"] = None
    # a trainer's start: load() finds no checkpoint and reserves the buffers for this
    # state in the background; the first save comes after (the wait stands for the
    # first training steps)
    def first_save(s: Any) -> tuple[float, float]:
        """(reservation s, first blocking save s) of saver ``s`` that found nothing."""
        assert s.load(like(state) if not lean else state) is None
        s.wait_reserved()
        t0 = time.perf_counter()
        s.save(1, state)
        t = time.perf_counter() - t0
        assert not s.last_save["laid_out"]
        if not lean:
            s.wait()
        return s.last_reserve["seconds"], t

    firsts = [first_save(saver)]
    flash.step = 1
    for i in range(max(repeat, 1) - 1 if not lean else 0):  # one first save per saver
        other = flash_saver(job, f"{ckpt}-first{i}")
        firsts.append(first_save(other))
        paths = list(other.paths)
        other.close()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
        shutil.rmtree(f"{ckpt}-first{i}", ignore_errors=True)
    out["reserve_s"] = statistics.median(r for r, _ in firsts)
    first = statistics.median(f for _, f in firsts)
    flash.save()  # slot 1 (lean: slot 0 again)
    if not lean:
        saver.wait()
    else:
        bound_path = saver.paths[0]
        seg = shm.Segment.attach(bound_path)
        assert seg is not None, bound_path
        bound_offset = seg.read_header().data_offset
        seg.close()
    bound.append(os.open(bound_path, os.O_RDONLY))
    flash.load()
    flash.unmap()
    times: dict[str, list[float]] = {"memcpy": [], "save": [], "load": [], "pread": [],
                                     "load_cold": [], "load_warm": [], "load_standby": []}
    pread_shm()
    for _ in range(max(repeat, 5)):
        times["memcpy"].append(median_s(memcpy, 1))
        times["pread"].append(median_s(pread_shm, 1))
        times["save"].append(median_s(flash.save, 1))
        if not lean:
            saver.wait()  # untimed: the persister's write would compete for the cores
        times["load"].append(median_s(flash.load, 1))
        flash.unmap()
        times["load_cold"].append(median_s(flash.load_made, 1, flash.make_saver))
        flash.unmap()
        times["load_warm"].append(median_s(flash.load_warm, 1))
        flash.premap()
        times["load_standby"].append(median_s(flash.load_standby, 1))
        flash.unmap()
        # untimed: the first save after a load starts the saver's new attempt (rank 0
        # writes the lineage file), which the timed save of the next round must not pay
        flash.save()
        if not lean:
            saver.wait()
    out["memcpy_gib_s"] = gib / statistics.median(times["memcpy"])
    out["flash_save_gib_s"] = gib / statistics.median(times["save"])
    out["flash_save_first_gib_s"] = gib / first
    out["first_over_steady"] = first / statistics.median(times["save"])
    out["save_over_memcpy"] = out["flash_save_gib_s"] / out["memcpy_gib_s"]
    out["load_memory_gib_s"] = gib / statistics.median(times["load"])
    out["pread_shm_gib_s"] = gib / statistics.median(times["pread"])
    out["load_over_memcpy"] = out["load_memory_gib_s"] / out["memcpy_gib_s"]
    out["load_warm_gib_s"] = gib / statistics.median(times["load_warm"])
    out["load_warm_vs_memcpy"] = out["load_warm_gib_s"] / out["memcpy_gib_s"]
    out["load_standby_gib_s"] = gib / statistics.median(times["load_standby"])
    out["load_standby_vs_memcpy"] = out["load_standby_gib_s"] / out["memcpy_gib_s"]
    out["load_over_pread_shm"] = out["load_memory_gib_s"] / out["pread_shm_gib_s"]
    out["load_cold_with_init_vs_preadv"] = out["load_over_pread_shm"]
    out["load_cold_gib_s"] = gib / statistics.median(times["load_cold"])
    out["load_cold_vs_preadv"] = out["load_cold_gib_s"] / out["pread_shm_gib_s"]
    pool.shutdown()
    os.close(bound[0])
    if not lean:
        os.unlink(bound_path)
    if not lean:  # (lean: the state is its own template; load() checked step and source)
        assert torch.equal(flash.template["model"]["layer0.weight"],
                           state["model"]["layer0.weight"])
    del flash, dst
    if lean:
        saver.wait()  # untimed: persisted once, so that close() leaves no write behind
    saver.close()  # the caller finishes the job: its buffers go

    path = os.path.join(work, f"state{size_mib}.pt")
    if lean:
        for k in ("torch_save_fsync_gib_s", "torch_load_gib_s", "load_over_torch_load",
                  "torch_load_warm_gib_s", "dcp_save_gib_s"):
            out[k] = None
        shutil.rmtree(ckpt, ignore_errors=True)
        return out

    def torch_save() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    out["torch_save_fsync_gib_s"] = gib / median_s(torch_save, repeat)

    def torch_load() -> None:
        loaded = torch.load(path, weights_only=True)
        assert loaded["model"]["layer0.weight"].numel() == state["model"]["layer0.weight"].numel()

    out["torch_load_gib_s"] = gib / median_s(torch_load, repeat, lambda: drop_cache(path))
    out["load_over_torch_load"] = out["load_memory_gib_s"] / out["torch_load_gib_s"]
    torch_load()
    out["torch_load_warm_gib_s"] = gib / median_s(torch_load, repeat)
    os.unlink(path)

    dcp_dir = os.path.join(work, f"dcp{size_mib}")

    def dcp_save() -> None:
        shutil.rmtree(dcp_dir, ignore_errors=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir, sync_files=True),
                 no_dist=True)

    out["dcp_save_gib_s"] = gib / median_s(dcp_save, repeat)
    shutil.rmtree(dcp_dir, ignore_errors=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


class CpuBench:
    """A Ray actor that runs :func:`bench_cpu` (on the benchmark's node), so that a size's
    memory is returned when the actor is killed."""

    def run(self, size_mib: int, work: str, repeat: int, job: str, lean: bool) -> dict:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        return bench_cpu(size_mib, work, repeat, job, lean)


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile``, ``RssShmem`` of a process, in
    bytes, from ``/proc/<pid>/status`` (Linux)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class RssSampler:
    """Samples ``/proc/<pid>/status`` every ``every_s`` seconds in a thread and keeps the
    peak of each field (``RssAnon``: private memory, ``RssShmem``: shared-memory pages
    mapped into the process). :meth:`stop` returns the peaks and the kernel's own
    ``VmHWM`` (the exact peak of the whole resident set), in bytes."""

    def __init__(self, pid: int | str = "self", every_s: float = 0.01) -> None:
        import threading

        self.pid, self.every_s = pid, every_s
        self.peak = proc_status(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for k, v in proc_status(self.pid).items():
                self.peak[k] = max(self.peak.get(k, 0), v)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        for k, v in proc_status(self.pid).items():
            self.peak[k] = max(self.peak.get(k, 0), v)
        return dict(self.peak)


def write_fsync_s(state: dict, path: str) -> float:
    """Seconds of a bare sequential write of the state's tensor bytes to a new file at
    ``path`` (unbuffered ``write`` of each tensor, then ``fsync``); the file is removed
    after."""
    from dlrover_core.atomic_io import write_all  # the persister's own write loop

    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for v in state["model"].values():
            write_all(f, memoryview(v.numpy()))
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return seconds


def crc32_s(state: dict) -> float:
    """Seconds of ``zlib.crc32`` over the state's tensor bytes in the persister's
    pieces (``storage.CHUNK``), one pass on one core: the bound of the persister's
    checksum."""
    import zlib

    from dlrover_plugin_flashckpt.storage import CHUNK

    t0 = time.perf_counter()
    crc = 0
    for v in state["model"].values():
        view = memoryview(v.numpy()).cast("B")
        for o in range(0, len(view), CHUNK):
            crc = zlib.crc32(view[o:o + CHUNK], crc)
    return time.perf_counter() - t0


def socket_copy_s(state: dict, repeat: int) -> float:
    """The bound of the TCP replica: a bare loopback TCP copy of the state's tensor
    bytes (``sendall`` of each tensor) into one populated buffer of their size
    (``recv_into`` in the replica stream's pieces, its socket buffer sizes), timed from
    the first byte sent until the receiver acknowledges the last one; a receiving
    thread, and the sender in this one (both calls leave the GIL). Median (s) of
    ``repeat`` copies after a first one."""
    import socket
    import threading

    from dlrover_plugin_flashckpt.replica_stream import RECV_CHUNK, SOCKET_BUFFER

    total = nbytes(state)
    dst = torch.empty(total, dtype=torch.uint8)
    dst.fill_(1)  # populated, as the holder's kept mappings are
    view = memoryview(dst.numpy()).cast("B")
    srv = socket.create_server(("127.0.0.1", 0))
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    rounds = repeat + 1
    failed: list[BaseException] = []

    def receive() -> None:
        try:
            with socket.create_connection(srv.getsockname()) as conn:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
                for _ in range(rounds):
                    off = 0
                    while off < total:
                        got = conn.recv_into(view[off:off + RECV_CHUNK])
                        if not got:
                            raise ConnectionError(f"closed after {off} of {total} bytes")
                        off += got
                    conn.sendall(b"\x01")
        except BaseException as exc:  # noqa: BLE001 - reported by the sender
            failed.append(exc)

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    conn, _ = srv.accept()
    seconds = []
    with conn:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for v in state["model"].values():
                conn.sendall(memoryview(v.numpy()).cast("B"))
            if conn.recv(1) != b"\x01":
                raise RuntimeError(f"socket copy not acknowledged: {failed}")
            seconds.append(time.perf_counter() - t0)
    receiver.join()
    srv.close()
    if failed:
        raise RuntimeError(f"socket copy failed: {failed[0]!r}")
    return statistics.median(seconds[1:])


class TrainerProbe:
    """A Ray actor that does only what a trainer's checkpointing does, for its peak
    resident memory: builds the state, saves it with a flash saver of ``slots`` slots
    (every save persisted) ``saves`` times, each waited for until committed, and after
    each save a bare write+fsync of the same bytes into the checkpoint directory (the
    same disk as the persister's)."""

    def run(self, size_mib: int, job: str, ckpt: str, saves: int, slots: int) -> dict:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        base = proc_status()
        sampler = RssSampler()
        state = make_state(size_mib)
        made = proc_status()
        saver = flash_saver(job, ckpt, slots=slots)
        writes = []
        for step in range(1, saves + 1):
            saver.save(step, state)
            saver.wait()
            if step > 1:  # the first save lays out the slot: not a steady persist
                writes.append(write_fsync_s(state, os.path.join(ckpt, "bare-write")))
        # after the saves: between them it would change when the next write follows the
        # last file removed (on a VM that hands freed memory back to its host, that
        # decides the speed of a write into the page cache: docs/flash-checkpoint.md)
        crcs = [crc32_s(state) for _ in writes]
        peak = sampler.stop()
        saver.close()
        return {"base": base, "made": made, "peak": peak, "write_fsync_s": writes,
                "crc32_s": crcs,
                "role": saver.context.role, "pid": os.getpid()}


def bench_probe(size_mib: int, work: str, job: str, repeat: int, slots: int = 2) -> dict:
    """The peak resident memory of a trainer process and of its persister during saves
    and persists, and the persister's write against a bare write+fsync (see the module
    docstring). A job of its own (``<job>-p<size>``: a new persister process, so that
    its ``VmHWM`` covers this size only), finished and its buffers removed at the end."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from dlrover_plugin_flashckpt import shm
    from dlrover_plugin_flashckpt.persister import finish_job, get_persister

    job = f"{job}-p{size_mib}"
    ckpt = os.path.join(work, f"probe{size_mib}")
    persister = get_persister(job)
    ppid = ray.get(persister.ready.remote())["pid"]
    pbase = proc_status(ppid)
    psampler = RssSampler(ppid)
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    probe = ray.remote(num_cpus=0)(TrainerProbe).options(scheduling_strategy=here).remote()
    try:
        got = ray.get(probe.run.remote(size_mib, job, ckpt, repeat + 1, slots))
        ppeak = psampler.stop()
        hist = [h for h in ray.get(persister.status.remote())["history"]
                if h["role"] == got["role"] and h["step"] > 1 and h["committed"]]
    finally:
        ray.kill(probe)
        finish_job(job, timeout=120)
        for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
            os.unlink(path)
        shutil.rmtree(ckpt, ignore_errors=True)
    state_bytes = (size_mib << 20) // 4 // N_TENSORS * 4 * N_TENSORS
    gib = state_bytes / GIB
    if len(hist) != repeat:
        raise RuntimeError(f"persister history has {len(hist)} committed steady persists, "
                           f"expected {repeat}: {hist}")
    persist = gib / statistics.median(h["seconds"] for h in hist)
    persist_write = gib / statistics.median(h["write_seconds"] for h in hist)
    bare = gib / statistics.median(got["write_fsync_s"])
    tpeak, tbase = got["peak"], got["base"]
    return {"persist_gib_s": persist, "write_fsync_gib_s": bare,
            "persist_vs_write_fsync": persist / bare,
            "persist_write_gib_s": persist_write,
            "persist_write_vs_write_fsync": persist_write / bare,
            "crc32_gib_s": gib / statistics.median(got["crc32_s"]),
            "peak_rss_trainer_bytes": tpeak["VmHWM"],
            "peak_rss_persister_bytes": ppeak["VmHWM"],
            "rss_detail": {
                "trainer_base_bytes": tbase["VmRSS"],
                "trainer_peak_anon_bytes": tpeak["RssAnon"],
                "trainer_peak_shmem_bytes": tpeak["RssShmem"],
                # private memory beyond the process's start and the state itself
                "trainer_extra_anon_bytes": tpeak["RssAnon"] - tbase["RssAnon"] - state_bytes,
                "persister_base_bytes": pbase["VmRSS"],
                "persister_peak_anon_bytes": ppeak["RssAnon"],
                "persister_peak_shmem_bytes": ppeak["RssShmem"],
                "persister_extra_anon_bytes": ppeak["RssAnon"] - pbase["RssAnon"]}}


def bench_replica(size_mib: int, work: str, repeat: int, job: str,
                  transport: str = "tcp") -> dict:
    """``replica_gib_s``: the persister's copy of one save into the peer node's memory
    (``replicas: 1``; ``transport`` tcp: one connection between the two persisters, into
    the peer's buffer; ray: Ray object store, object transfer between the two raylets of
    this machine, copy into the peer's buffer), median of ``repeat`` saves after a first
    one that laid out the peer's buffers; ``replica_lag_s``: from the save's return to
    the replica being complete. Runs as a job of its own (``<job>-r<size><transport>``)
    whose buffers, slots and replicas, are removed at the end, so that the next size
    and transport have the memory."""
    import ray

    from dlrover_plugin_flashckpt import shm
    from dlrover_plugin_flashckpt.persister import finish_job, get_persister

    job = f"{job}-r{size_mib}{transport}"
    state = make_state(size_mib)
    gib = nbytes(state) / GIB
    ckpt = os.path.join(work, f"replica{size_mib}{transport}")
    saver = flash_saver(job, ckpt, replicas=1, persist_every_steps=10**9,
                        replica_transport=transport)
    persister = get_persister(job)
    seconds, lags, split = [], [], {"connect_s": [], "stream_s": []}
    for step in range(1, repeat + 2):
        saver.save(step, state)
        t0 = time.perf_counter()
        # one call that returns when the replica is recorded (polling the persister
        # would take CPU from the copy it times); the history holds every size's
        # replica saver: this one's role
        hist = ray.get(persister.wait_replica.remote(saver.context.role, step, 1, 600))
        if not hist:
            raise TimeoutError(f"no replica of step {step} within 600 s")
        if hist[0]["transport"] != transport:
            raise RuntimeError(f"replica of step {step} went through {hist[0]['transport']}, "
                               f"not {transport}: see the persister's log")
        if step > 1:
            seconds.append(hist[0]["seconds"])
            lags.append(time.perf_counter() - t0)
            for k, v in split.items():
                if k in hist[0]:
                    v.append(hist[0][k])
    saver.close()
    finish_job(job, timeout=60)   # the persisters stop and unmap the buffers
    for path in shm.list_segments("/dev/shm", shm.job_prefix(job)):
        os.unlink(path)           # not committed (never persisted): finish_job keeps them
    shutil.rmtree(ckpt, ignore_errors=True)
    out = {"replica_gib_s": gib / statistics.median(seconds),
           "replica_lag_s": statistics.median(lags)}
    out.update({f"replica_{k}": statistics.median(v) for k, v in split.items() if v})
    return out


class ReshardRank:
    """A Ray actor holding one rank of a ``Shard(0)`` DTensor state (FSDP2's layout)
    on a gloo process group, saving or loading it through the flash saver."""

    def __init__(self, rank: int, world: int, init_method: str, size_mib: int, job: str,
                 ckpt: str) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
        from dlrover_plugin_flashckpt.saver import FlashSaver

        torch.set_num_threads(max(1, os.cpu_count() or 1))
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world)
        self.mesh = init_device_mesh("cpu", (world,))
        self.size_mib, self.rank = size_mib, rank
        self.saver = FlashSaver(SaverConfig(dir=ckpt, keep=1, job=job, options={}),
                                SaverContext(rank=rank, world_size=world, distributed=True,
                                             role=os.path.basename(ckpt)))

    def _state(self, fill: bool) -> dict:
        from torch.distributed.tensor import Shard, distribute_tensor

        full = make_state(self.size_mib)
        out = {"model": {}, "extra": {"step": 0}}
        for k, v in full["model"].items():
            d = distribute_tensor(v if fill else torch.zeros_like(v), self.mesh, [Shard(0)])
            out["model"][k] = d
        return out

    def save(self, step: int) -> None:
        self.saver.save(step, self._state(True))
        self.saver.wait()

    def load(self) -> dict:
        template = self._state(False)
        t0 = time.perf_counter()
        step = self.saver.load(template)
        seconds = time.perf_counter() - t0
        want = make_state(self.size_mib)["model"]["layer3.weight"]
        got = template["model"]["layer3.weight"].full_tensor()
        return {"step": step, "source": self.saver.last_load_source, "seconds": seconds,
                "exact": bool(torch.equal(got, want))}


def bench_reshard(size_mib: int, work: str, job: str, repeat: int) -> dict:
    """``restore_other_world_size_s``: a state saved by 2 ranks (``Shard(0)``
    DTensors, gloo) loaded into 1 rank from shared memory (and, for comparison, the
    load of the same state saved by 1 rank: ``restore_same_world_size_s``); each the
    median of ``repeat`` loads by new actors; ``restore_other_over_same`` their ratio."""
    import uuid

    import ray

    def rendezvous() -> str:
        """A new file rendezvous (``FileStore``): no port to pick, so none another
        process can take between the pick and the bind (a run failed on EADDRINUSE)."""
        return f"file://{os.path.join(work, 'rdzv-' + uuid.uuid4().hex)}"

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0)(ReshardRank).options(scheduling_strategy=here)
    ckpt = os.path.join(work, f"reshard{size_mib}")
    p = rendezvous()
    two = [actor.remote(r, 2, p, size_mib, job, ckpt) for r in range(2)]
    ray.get([a.save.remote(1) for a in two])
    for a in two:
        ray.kill(a)

    def loads(step: int, source: str) -> list[float]:
        """Seconds of ``repeat`` loads, each by a new 1-rank actor (a restarted trainer)."""
        seconds = []
        for _ in range(repeat):
            one = actor.remote(0, 1, rendezvous(), size_mib, job, ckpt)
            got = ray.get(one.load.remote())
            assert got["step"] == step and got["source"] == source and got["exact"], got
            seconds.append(got["seconds"])
            if step == 1 and len(seconds) == repeat:  # the same state saved by one rank
                ray.get(one.save.remote(2))
            ray.kill(one)
        return seconds

    other = loads(1, "memory-resharded")
    same = loads(2, "memory")
    shutil.rmtree(ckpt, ignore_errors=True)
    return {"restore_other_world_size_s": statistics.median(other),
            "restore_same_world_size_s": statistics.median(same),
            "restore_other_over_same": statistics.median(other) / statistics.median(same)}


def bench_gpu(size_mib: int, work: str, repeat: int, job: str) -> dict:
    state, gib, out = gpu_state(size_mib)
    out["d2h_pinned_gib_s"] = gib / pinned_d2h_s(state, repeat)
    ckpt = os.path.join(work, f"gpuflash{size_mib}")
    flash = FlashRounds(job, ckpt, state, sync=torch.cuda.synchronize)
    saver = flash.saver
    median_s(flash.save, 2, saver.wait)
    saver.wait()
    out["flash_save_gib_s"] = gib / median_s(flash.save, repeat, saver.wait)
    saver.wait()
    flash.load()
    flash.unmap()
    out["load_memory_gib_s"] = gib / median_s(flash.load, repeat, flash.unmap)
    flash.unmap()
    saver.close()
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def bench_gpu_copy_path(size_mib: int, repeat: int) -> dict:
    """The blocking part of a flash save of a GPU-resident state, with the saver's own
    pieces (tensor table, shared-memory slot, ``shm.pin_buffers``, ``copy_``) but no
    persister: for machines without Ray (``--gpu-copy-path``)."""
    from dlrover_plugin_flashckpt import layout, shm

    state, gib, out = gpu_state(size_mib)
    out["mode"] = "copy path, no persister"
    out["d2h_pinned_gib_s"] = gib / pinned_d2h_s(state, repeat)
    seg, table, _, skeleton, views = shm_slot(state, "gpubench", size_mib)
    try:
        def save(non_blocking: bool) -> Callable[[], None]:
            def run() -> None:
                _, sources, _ = layout.build_table(state)  # as every save does
                copy_all(views, sources, non_blocking)
            return run

        save(False)()
        out["flash_save_unpinned_gib_s"] = gib / median_s(save(False), repeat)
        bases = shm.pin_buffers([seg])
        save(True)()
        out["flash_save_gib_s"] = gib / median_s(save(True), repeat)
        template = like(state)
        by_path = {e.path: v for e, v in zip(table, views)}

        def load() -> None:
            layout.restore(template, skeleton, table, lambda e: by_path[e.path], "bench")
            torch.cuda.synchronize()

        load()
        out["load_memory_gib_s"] = gib / median_s(load, repeat)
        assert torch.equal(template["model"]["layer0.weight"], state["model"]["layer0.weight"])
        shm.unpin_buffers(bases)
        del views, template, by_path
    finally:
        seg.close()
        os.unlink(seg.path)
    return out


def bench_gpu_staging(size_mib: int, repeat: int) -> dict:
    """Device-to-host copy of a GPU-resident state (the D2H of a flash save):
    ``pinned_shm_d2h_gib_s``, the segment page-locked and one ``copy_(non_blocking=True)``
    per tensor into it (the save's first choice); ``staged_d2h_gib_s``,
    :class:`dlrover_plugin_flashckpt.staging.HostStaging` (pinned
    staging buffers on a side stream, then into a shared-memory segment), against
    ``to_cpu_non_blocking_gib_s``, a plain ``tensor.to("cpu", non_blocking=True)``
    of the same tensors into pinned memory (the target is preallocated: ``copy_`` into
    pinned tensors), both waited for with ``torch.cuda.synchronize()``."""
    from dlrover_plugin_flashckpt import shm
    from dlrover_plugin_flashckpt.staging import HostStaging

    state, gib, out = gpu_state(size_mib)
    out["to_cpu_non_blocking_gib_s"] = gib / pinned_d2h_s(state, repeat)
    seg, _, sources, _, views = shm_slot(state, "gpustage", size_mib)
    try:
        staging = HostStaging()

        def staged() -> None:
            staging.copy(views, sources)

        staged()
        out["staged_d2h_gib_s"] = gib / median_s(staged, repeat)
        assert torch.equal(views[0].view(-1), sources[0].view(-1).cpu())
        staging.close()
        # the save's first choice: the segment page-locked, one DMA per tensor into it
        bases = shm.pin_buffers([seg])
        try:
            def direct() -> None:
                copy_all(views, sources, True)

            direct()
            out["pinned_shm_d2h_gib_s"] = gib / median_s(direct, repeat)
        finally:
            shm.unpin_buffers(bases)
        del views
    finally:
        seg.close()
        os.unlink(seg.path)
    return out


def _d2h_line(g: dict) -> str:
    return (f"pinned shm D2H {g['pinned_shm_d2h_gib_s']:.2f} | staged D2H "
            f"{g['staged_d2h_gib_s']:.2f} GiB/s | to('cpu', non_blocking) pinned "
            f"{g['to_cpu_non_blocking_gib_s']:.2f}")


def _copy_path_line(g: dict) -> str:
    return (f"D2H pinned {g['d2h_pinned_gib_s']:.2f} GiB/s | flash save "
            f"{g['flash_save_gib_s']:.2f} (unpinned {g['flash_save_unpinned_gib_s']:.2f}) | "
            f"load memory -> GPU {g['load_memory_gib_s']:.2f}")


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _cpu_line(r: dict) -> str:
    return (f"{r['size_mib']:5d} MiB{' (lean)' if r['lean'] else ''}  memcpy "
            f"{r['memcpy_gib_s']:6.2f} GiB/s | flash save {r['flash_save_gib_s']:6.2f} (first "
            f"{r['flash_save_first_gib_s']:.2f}, unreserved "
            f"{_fmt(r['flash_save_unreserved_gib_s'])}) | torch.save+fsync "
            f"{_fmt(r['torch_save_fsync_gib_s'])} | dcp {_fmt(r['dcp_save_gib_s'])} | load memory "
            f"{r['load_memory_gib_s']:6.2f} (pread {r['pread_shm_gib_s']:.2f}, cold "
            f"{r['load_cold_gib_s']:.2f}, warm "
            f"{r['load_warm_gib_s']:.2f}, standby {r['load_standby_gib_s']:.2f}) | torch.load disk "
            f"{_fmt(r['torch_load_gib_s'])} (page cache {_fmt(r['torch_load_warm_gib_s'])}) | "
            f"persist {r['persist_gib_s']:.2f} (files {r['persist_write_gib_s']:.2f}; bare "
            f"write+fsync {r['write_fsync_gib_s']:.2f}; crc32 {r['crc32_gib_s']:.2f}) | "
            f"peak RSS trainer {r['peak_rss_trainer_bytes'] / GIB:.2f} GiB, persister "
            f"{r['peak_rss_persister_bytes'] / GIB:.2f} GiB | replica {_fmt(r['replica_gib_s'])} "
            f"(ray {_fmt(r['replica_ray_gib_s'])}; bare socket {_fmt(r['socket_copy_gib_s'])}) "
            f"| restore 2->1 ranks "
            f"{_fmt(r['restore_other_world_size_s'], '.3f')} s (1->1 "
            f"{_fmt(r['restore_same_world_size_s'], '.3f')} s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="256,1024",
                   help="comma-separated state sizes in MiB (float32)")
    p.add_argument("--repeat", type=int, default=3, help="runs per figure (median)")
    p.add_argument("--full-max-mib", type=int, default=1024,
                   help="sizes above this many MiB run lean: no figure that needs a second "
                        "copy of the state or more savers (those are null; see the module "
                        "docstring)")
    p.add_argument("--gpu-copy-path", action="store_true",
                   help="only the GPU-resident state, through the save's copy path without "
                        "Ray or a persister (for a GPU machine without Ray)")
    p.add_argument("--gpu-d2h", action="store_true",
                   help="only the D2H figure of a GPU-resident state: staged copy into "
                        "shared memory vs tensor.to('cpu', non_blocking=True) into pinned "
                        "memory (needs CUDA; no Ray)")
    p.add_argument("--dir", default=None, help="local-disk work directory (default: a temp "
                   "dir under the current directory)")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes_mib.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes-mib {args.sizes_mib!r}: use integers separated by commas, e.g. 256,1024")
    if not sizes or min(sizes) < N_TENSORS * 4 // 1024 + 1:
        p.error(f"--sizes-mib {args.sizes_mib!r}: sizes must be >= 1 MiB")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: use an integer >= 1")
    if args.full_max_mib < 0:
        p.error(f"--full-max-mib {args.full_max_mib}: use an integer >= 0 (MiB)")

    if args.gpu_d2h or args.gpu_copy_path:  # GPU only, no Ray
        if not torch.cuda.is_available():
            p.error(f"{'--gpu-d2h' if args.gpu_d2h else '--gpu-copy-path'} needs a CUDA GPU")
        bench, key, line = ((bench_gpu_staging, "gpu_d2h", _d2h_line) if args.gpu_d2h
                            else (bench_gpu_copy_path, "gpu", _copy_path_line))
        figures = []
        for size in sizes:
            g = bench(size, args.repeat)
            figures.append({k: round(v, 3) if isinstance(v, float) else v for k, v in g.items()})
            print(f"{size:5d} MiB on {g['device']}: {line(g)}", file=sys.stderr, flush=True)
        print(json.dumps({key: figures}))
        return 0

    import ray
    from ray.cluster_utils import Cluster

    from dlrover_core.master.client import init_ray
    from dlrover_plugin_flashckpt import shm
    from dlrover_plugin_flashckpt.persister import finish_job

    ray_tmp = tempfile.mkdtemp(prefix="dlrbench", dir="/tmp")
    work = tempfile.mkdtemp(prefix="flashbench", dir=args.dir or os.getcwd())
    job = f"flashbench-{os.getpid()}"
    # two raylets on this machine: the head (this process, the persister) and a peer
    # node that holds the replicas
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "temp_dir": ray_tmp, "include_dashboard": False})
    cluster.add_node(num_cpus=0)
    cluster.wait_for_nodes()
    init_ray(cluster.address)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    results, gpu = [], []
    try:
        for size in sizes:
            lean = size > args.full_max_mib
            cjob = f"{job}-c{size}"
            # in an actor of its own, killed after: whatever a size kept (its state, its
            # mappings) is gone before the probe and the next size
            bench = ray.remote(num_cpus=0)(CpuBench).options(scheduling_strategy=here).remote()
            try:
                r = ray.get(bench.run.remote(size, work, args.repeat, cjob, lean))
            finally:  # its persister unmaps the buffers: the memory is free again
                ray.kill(bench)
                finish_job(cjob, timeout=120)
                for path in shm.list_segments("/dev/shm", shm.job_prefix(cjob)):
                    os.unlink(path)
            r.update(bench_probe(size, work, job, args.repeat, 1 if lean else 2))
            r["probe_slots"] = 1 if lean else 2
            if lean:
                for k in ("replica_gib_s", "replica_lag_s", "replica_over_memcpy",
                          "replica_connect_s", "replica_stream_s",
                          "socket_copy_gib_s", "replica_vs_socket",
                          "replica_ray_gib_s", "replica_ray_lag_s",
                          "restore_other_world_size_s", "restore_same_world_size_s",
                          "restore_other_over_same"):
                    r[k] = None
            else:
                r.update(bench_replica(size, work, max(args.repeat, 3), job))
                r["replica_over_memcpy"] = r["replica_gib_s"] / r["memcpy_gib_s"]
                state = make_state(size)
                r["socket_copy_gib_s"] = (nbytes(state) / GIB
                                          / socket_copy_s(state, max(args.repeat, 3)))
                del state
                r["replica_vs_socket"] = r["replica_gib_s"] / r["socket_copy_gib_s"]
                ray_path = bench_replica(size, work, max(args.repeat, 3), job, "ray")
                r["replica_ray_gib_s"] = ray_path["replica_gib_s"]
                r["replica_ray_lag_s"] = ray_path["replica_lag_s"]
                r.update(bench_reshard(size, work, job, max(args.repeat, 3)))
            results.append(r)
            print(_cpu_line(r), file=sys.stderr, flush=True)
        if torch.cuda.is_available():
            for size in sizes:
                g = bench_gpu(size, work, args.repeat, job)
                gpu.append(g)
                print(f"{size:5d} MiB on {g['device']}: D2H pinned {g['d2h_pinned_gib_s']:.2f} "
                      f"GiB/s | flash save {g['flash_save_gib_s']:.2f} | load memory -> GPU "
                      f"{g['load_memory_gib_s']:.2f}", file=sys.stderr, flush=True)
    finally:
        finish_job(job, timeout=60)
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    for r in results + gpu:
        for k, v in r.items():
            if isinstance(v, float):
                r[k] = round(v, 3)
    line: dict[str, Any] = {"results": results}
    if gpu:
        line["gpu"] = gpu
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
