"""The worker-side half of an SPMD backend."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from dlrover_core.ports import free_port

if TYPE_CHECKING:
    from dlrover_core.runtime.context import WorkerContext

#: port -> the TCPStore server rank 0 opened for its role's next rendezvous
#: (:meth:`TorchDistributedSession.open_rendezvous`), until its setup takes it
_OPEN_STORES: dict[int, Any] = {}


class BackendSession:
    """Sets up a role's process group in one worker and wraps its models.

    Backends subclass it (``dlrover_plugin_fsdp.backend:FSDPSession``) and name the
    subclass in their ``Backend`` record. Constructed in the worker process after
    ``MASTER_ADDR``/``MASTER_PORT`` are set.
    """

    #: Every rank holds the whole training state (DDP): after a failure, the ranks of
    #: the role heal from a survivor's live state instead of a checkpoint
    #: (:mod:`dlrover_core.checkpoint.heal`). False for sharded state (FSDP).
    replicated_state = False

    def __init__(self, context: WorkerContext) -> None:
        self.context = context

    @property
    def device(self) -> Any:
        """The ``torch.device`` this rank computes on."""
        import torch

        return torch.device("cpu")

    def warm_up(self) -> None:
        """Standby only, before it knows its rank and without a peer: pay this backend's
        one-off process costs (imports, the first use of its wrap and of a training step)
        so that a promoted standby does not. Must not touch CUDA (a spare may have no
        GPU yet) and must leave no process group behind. The standby runs it in a thread
        of its own (``dlrover_core.runtime.warming.in_own_thread``: what torch caches per
        thread from a fake group, as rank 0, must not reach the rank the spare becomes).
        Default: nothing."""

    def open_rendezvous(self) -> int:
        """Rank 0 only, before any rank's :meth:`setup`: get the role's rendezvous
        ready on this node and return its TCP port (``MASTER_PORT``). Default: a free
        port."""
        return free_port(host="")

    def setup(self) -> None:
        """Join the role's process group. Called once per (re)start."""

    def wrap(self, model: Any, **kwargs: Any) -> Any:
        """Return the model ready for data-parallel training (default: unchanged)."""
        return model

    def teardown(self) -> None:
        """Leave the process group. Must not raise when the group is broken."""


class TorchDistributedSession(BackendSession):
    """A torch.distributed process group per role, formed in a ``TCPStore`` at the
    role's rendezvous (``MASTER_ADDR``/``MASTER_PORT``), ``rank``/``world_size`` of the
    role, the job's ``failover.pg_timeout_s``; NCCL on ``cuda:<context.cuda_device>``
    (the GPU Ray reserved for this rank, see :mod:`dlrover_core.runtime.devices`) when
    the rank has one and CUDA is available, else gloo on the CPU. Backends built on
    torch.distributed (DDP, FSDP, DeepSpeed, Megatron) subclass it. torch is imported
    here only when used.

    Rank 0's store server is opened before any rank joins (:meth:`open_rendezvous`):
    a ``TCPStore`` client that comes before its server is listening retries only
    after torch's connect back-off, which made ``init_process_group`` of 2 gloo ranks
    take 0.43-0.69 s when rank 0 came 0.05-0.2 s late, against 0.01-0.02 s when it came
    first (torch 2.13, 2 local processes, ``tcp://`` init)."""

    def open_rendezvous(self) -> int:
        """Open rank 0's ``TCPStore`` server on a free port of this node (all
        interfaces) and keep it for :meth:`setup`; returns the port. A server opened
        earlier whose setup never came is closed."""
        import torch.distributed as dist

        _OPEN_STORES.clear()
        store = dist.TCPStore("127.0.0.1", 0, int(self.context.world_size), True,
                              timeout=self.timeout, wait_for_workers=False)
        _OPEN_STORES[store.port] = store
        return int(store.port)

    def _store(self) -> Any:
        """This rank's ``TCPStore`` of the rendezvous: rank 0 takes the server
        :meth:`open_rendezvous` opened on ``MASTER_PORT`` (or opens it now), the others
        connect to it."""
        import torch.distributed as dist

        ctx = self.context
        rank0 = int(ctx.rank) == 0
        store = _OPEN_STORES.pop(int(ctx.master_port), None) if rank0 else None
        if store is None:
            store = dist.TCPStore(ctx.master_addr, int(ctx.master_port), int(ctx.world_size),
                                  rank0, timeout=self.timeout, wait_for_workers=False)
        return store

    @property
    def device(self) -> Any:
        import torch

        index = self.context.cuda_device
        if index is not None and torch.cuda.is_available():
            return torch.device("cuda", index)
        return torch.device("cpu")

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def timeout(self) -> Any:
        """The collective timeout, a ``datetime.timedelta``."""
        import datetime

        return datetime.timedelta(seconds=float(self.context.failover.get("pg_timeout_s", 120)))

    @contextlib.contextmanager
    def fake_group(self) -> Iterator[None]:
        """For a warm-up: a default process group of the role's ``world_size`` in this
        process alone, as rank 0, on torch's ``fake`` backend (its collectives return at
        once without communicating, so their results are wrong); destroyed on exit.

        Raises:
            RuntimeError: a process group is already initialized in this process.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("fake_group(): a process group is already initialized here")
        dist.init_process_group(dist.Backend.FAKE, rank=0,
                                world_size=max(1, int(self.context.world_size)))
        try:
            yield
        finally:
            dist.destroy_process_group()

    def setup(self) -> None:
        import torch
        import torch.distributed as dist

        ctx = self.context
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(self.dist_backend, store=self._store(), rank=ctx.rank,
                                world_size=ctx.world_size, timeout=self.timeout)

    def teardown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot always be destroyed
                pass
