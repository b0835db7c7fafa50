"""``FlashCheckpointer``: flash checkpoints for a plain torchrun script, without a
workload class (the shape of DLRover's ``DdpCheckpointer`` / ``FsdpCheckpointer``)::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from dlrover_plugin_flashckpt import FlashCheckpointer

    ckpt = FlashCheckpointer("ckpt")                       # rank, world size: from the env
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DDP, FSDP2 or a plain module
    state = {"model": model_sd, "optim": optim_sd, "extra": {"epoch": 0}}
    step = ckpt.load(state)                                # None: nothing saved yet
    if step is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    ...
    ckpt.save(step, {"model": model_sd, "optim": optim_sd, ...})   # memcpy time

It wraps :class:`.saver.FlashSaver`: :meth:`FlashCheckpointer.save` copies the state
into this rank's shared-memory buffer and returns; the node's persister (a Ray actor
that outlives the script) writes every ``persist_every_steps``-th save to ``dir``.
:meth:`FlashCheckpointer.load` reads the newest step every rank holds in memory (a
restarted script on the same node: ``last_load_source == "memory"``), else the newest
committed step on disk. State dicts: nested dicts/lists of tensors (DTensors save and
load their local shard, as torch.distributed.checkpoint's state dicts of FSDP2 hold
them) and small plain values.

Where it runs: under ``dlrover-run`` (or a script role) the rank, world size and local
rank come from torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``, the job and role
from ``DLROVER_JOB`` / ``DLROVER_ROLE``, and Ray from ``RAY_ADDRESS``, which the script
role sets. Under plain ``torchrun`` call ``ray.init()`` first; without Ray it raises
(there is no disk-only mode: the persister is what writes to disk).
"""

from __future__ import annotations

import os
import time
from typing import Any

from dlrover_core.checkpoint.saver import step_dir_name
from dlrover_core.script_api import report_checkpoint, report_checkpoint_loaded


def _env_int(key: str, default: int | None = None) -> int:
    v = os.environ.get(key)
    if v is None:
        if default is None:
            raise RuntimeError(f"FlashCheckpointer reads the rank from the environment: {key} "
                               "is not set; run the script under dlrover-run or torchrun")
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {key}={v!r} is invalid; allowed: an "
                         "integer") from None


def _connect_ray() -> None:
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        raise RuntimeError("FlashCheckpointer needs Ray for the node's persister, and "
                           "RAY_ADDRESS is not set: run the script under dlrover-run (which "
                           "sets it), or call ray.init(address=...) before creating it")
    from dlrover_core.master.client import init_ray

    init_ray(address)


class FlashCheckpointer:
    """Flash checkpoints of one rank of a torchrun script (see the module docstring).

    Args:
        dir: where committed steps go (``<dir>/step_<8 digits>``); shared by every
            node; relative to the current directory.
        keep: committed steps kept (>= 1).
        **options: options of the flash saver (``persist_every_steps``, ``slots``,
            ``shm_dir``, ``reserve_mib``, ``replicas``, ...; plugins/flashckpt/README.md).
    Raises:
        RuntimeError: ``RANK`` / ``WORLD_SIZE`` unset, or Ray cannot be reached.
        SpecError: a bad option or ``keep`` (names ``checkpoint.options.<key>``).
    """

    def __init__(self, dir: str, keep: int = 3, **options: Any) -> None:
        from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
        from dlrover_plugin_flashckpt.saver import FlashSaver

        rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK", 0)
        job = os.environ.get("DLROVER_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") \
            or "torchrun"
        role = os.environ.get("DLROVER_ROLE") or "trainer"
        _connect_ray()
        self._saver = FlashSaver(
            SaverConfig(dir=dir, keep=keep, job=job, options=dict(options)),  # abspath there
            SaverContext(rank=rank, world_size=world_size, local_rank=local_rank, role=role,
                         distributed=True))

    @property
    def rank(self) -> int:
        return self._saver.rank

    @property
    def world_size(self) -> int:
        return self._saver.world_size

    @property
    def dir(self) -> str:
        return self._saver.dir

    @property
    def last_load_source(self) -> str | None:
        """Where the last :meth:`load` read from: ``memory``, ``replica``,
        ``memory-resharded``, ``disk``, ``disk-resharded``, or ``None``."""
        return self._saver.last_load_source

    def save(self, step: int, state_dict: dict) -> None:
        """Copy ``state_dict`` into shared memory as ``step`` (blocking only for the
        copy) and return. Raises ``ValueError`` for a negative step, ``TypeError`` for
        an unsupported value (see :meth:`.saver.FlashSaver.save`).

        In a script role the saved step is then reported to the JobMaster as a
        workload's checkpointer reports it (``checkpoint_saved``, with the copy time;
        fire-and-forget, :func:`dlrover_core.script_api.report_checkpoint`): the
        events and ``dlrover timeline`` show it, and an elastic role grows at it."""
        t0 = time.perf_counter()
        self._saver.save(step, state_dict)
        report_checkpoint(int(step), time.perf_counter() - t0)

    def load(self, state_dict: dict, step: int | None = None) -> int | None:
        """Fill ``state_dict``'s tensors in place with the newest step (or ``step``):
        from memory when every rank holds it, else from disk. Returns the step, or
        ``None`` when nothing was saved. Call it on every rank (the ranks agree on the
        step through the script's process group). Raises ``LayoutError`` /
        ``CheckpointLoadError`` as :meth:`.saver.FlashSaver.load`. In a script role a
        loaded step is reported to the JobMaster (``checkpoint_loaded``, with
        :attr:`last_load_source`)."""
        loaded = self._saver.load(state_dict, step)
        if loaded is not None:
            report_checkpoint_loaded(loaded, self.last_load_source,
                                     os.path.join(self.dir, step_dir_name(loaded)))
        return loaded

    def committed_steps(self) -> list[int]:
        """Steps committed to :attr:`dir`, oldest first."""
        return self._saver.committed_steps()

    def wait(self) -> None:
        """Block until the newest save is committed to disk (persisted now even when
        not due). Raises ``TimeoutError`` after ``wait_timeout_s``."""
        self._saver.wait()

    def close(self) -> None:
        """Ask the persister to persist the newest save and release the buffers'
        mappings (they stay in memory for a restart)."""
        self._saver.close()
