"""What a script role's rank gives its script (:mod:`dlrover_core.runtime.script`):
torchrun's environment (:func:`torchrun_env`, :func:`agent_store`), the GPUs it sees
(:func:`visible_devices`), the signal it is stopped with (:func:`set_stop_signal`,
:func:`stop_signal`), its stdout and stderr kept apart (:class:`ScriptStreams`) and how
its exit is described (:func:`describe_exit`)."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import termios
import threading
import time
from typing import Any

from dlrover_core.runtime import warm_script


def agent_store(ctx: object) -> bool:
    """Whether rank 0's actor hosts the rendezvous store of ``ctx``'s attempt
    (:func:`.warm_script.host_store`): from the first restart on, unless
    ``DLROVER_WARM_RESTART=0``. The same answer on every rank of the attempt.

    Raises:
        ValueError: ``DLROVER_WARM_RESTART`` is neither ``0`` nor ``1``.
    """
    return int(ctx.attempt) >= 1 and warm_script.spares_enabled()


def torchrun_env(ctx: object, max_restarts: int) -> dict[str, str]:
    """The environment torchrun gives worker ``ctx.rank`` (strings), from a
    ``WorkerContext``: restart count = ``ctx.attempt`` (every rank of the group is
    restarted together, so all share it); run id = the job's name (``dlrover-run``
    names the job after ``--rdzv-id`` when it is given);
    ``TORCHELASTIC_USE_AGENT_STORE`` = :func:`agent_store` (``"True"``/``"False"``)."""
    local_world = max(1, int(ctx.local_world_size))
    env = dict(ctx.env())
    env.update({
        "ROLE_RANK": str(ctx.rank),
        "ROLE_WORLD_SIZE": str(ctx.world_size),
        "GROUP_WORLD_SIZE": str(max(1, int(ctx.world_size) // local_world)),
        "TORCHELASTIC_RESTART_COUNT": str(ctx.attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": ctx.job,
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store(ctx)),
    })
    return env


#: the signals torchrun's workers are told it handles (``--signals-to-handle``'s default)
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
#: the role variable through which ``dlrover-run`` passes torchrun's ``--role``
TORCHRUN_ROLE_VAR = "DLROVER_TORCHRUN_ROLE"
_KV_NAMESPACE = "dlrover-script-stop"


def set_stop_signal(job: str, signum: int | None, grace_s: float = 5.0) -> None:
    """Make every rank of job ``job`` stop its script with ``signum`` and SIGKILL after
    ``grace_s`` s (``None``: back to SIGTERM and 5 s), through Ray's internal key-value
    store (this process must be connected to the job's cluster). ``dlrover-run`` calls
    it before stopping the job when it got a signal."""
    from ray.experimental import internal_kv

    key = job.encode()
    if signum is None:
        internal_kv._internal_kv_del(key, namespace=_KV_NAMESPACE)
        return
    internal_kv._internal_kv_put(key, f"{int(signum)} {float(grace_s)}".encode(),
                                 overwrite=True, namespace=_KV_NAMESPACE)


def stop_signal(job: str) -> tuple[int, float]:
    """The signal and grace (s) a rank of ``job`` stops its script with:
    :func:`set_stop_signal`'s, else ``(SIGTERM, 5.0)``."""
    try:
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(job.encode(), namespace=_KV_NAMESPACE)
        if value:
            sig, grace = value.decode().split()
            return int(sig), float(grace)
    except Exception:  # noqa: BLE001 - not connected to Ray: the default
        pass
    return int(signal.SIGTERM), 5.0


def visible_devices(gpu_ids: list, local_rank: int, node_gpus: list[str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a rank that Ray gave ``gpu_ids`` (the first is its
    GPU), on a node whose GPUs are ``node_gpus`` (ids): every GPU of the node, its own at
    index ``local_rank`` and the others in order around it, so that
    ``cuda:<LOCAL_RANK>`` is the GPU Ray reserved for it while the other ranks' GPUs
    stay visible (as under torchrun). When the node lists fewer than ``local_rank + 1``
    GPUs, only its own ids."""
    own = [str(i) for i in gpu_ids]
    others = [str(g) for g in node_gpus if str(g) not in own]
    if not own or len(others) + 1 <= local_rank:
        return ",".join(own)
    return ",".join(others[:local_rank] + [own[0]] + others[local_rank:] + own[1:])


def describe_exit(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL (9)"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"signal {name} ({-returncode})"
    return f"exit code {returncode}"


def wait_output_written(path: str, limit_s: float, poll_s: float = 0.01) -> None:
    """Wait (at most ``limit_s`` s) until this process's captured output has reached
    ``path``: the pipe behind file descriptor 1 (:mod:`.log_capture`) holds no unread
    byte and the file's size stayed the same over one ``poll_s`` s poll."""
    deadline = time.monotonic() + limit_s
    last = -2
    while time.monotonic() < deadline:
        try:
            unread = struct.unpack("i", fcntl.ioctl(1, termios.FIONREAD, b"\0" * 4))[0]
        except OSError:  # not a pipe: nothing in flight
            unread = 0
        try:
            size = os.path.getsize(path)
        except OSError:
            size = -1
        if unread == 0 and size == last:
            return
        last = size
        time.sleep(poll_s)


class ScriptStreams:
    """The stdout and stderr of one attempt's script, kept apart: two pipes whose write
    ends (:attr:`fds`) the script gets as its file descriptors 1 and 2; a thread per pipe
    copies what it reads to this process's own descriptor of the same stream (the job's
    log capture: the attempt's log, both streams interleaved as before) and to
    ``<base>.stdout`` / ``<base>.stderr`` (rotated at ``max_bytes``, one old part kept),
    which ``dlrover-run`` prints to its own stdout and stderr. A file left by an earlier
    run is replaced (a new file, so that a reader sees it is new)."""

    def __init__(self, base: str, max_bytes: int) -> None:
        from dlrover_core.runtime.log_capture import RotatingFile

        self.fds: tuple[int, ...] = ()
        self._threads: list[threading.Thread] = []
        fds = []
        for name, own in (("stdout", 1), ("stderr", 2)):
            path = f"{base}.{name}"
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            out = RotatingFile(path, max_bytes, 1)
            r, w = os.pipe()
            t = threading.Thread(target=self._pump, args=(r, own, out), daemon=True,
                                 name=f"dlrover-script-{name}")
            t.start()
            fds.append(w)
            self._threads.append(t)
        self.fds = tuple(fds)

    @staticmethod
    def _pump(r: int, own: int, out: Any) -> None:
        try:
            while True:
                data = os.read(r, 65536)
                if not data:
                    return
                view = memoryview(data)
                try:
                    while view:
                        view = view[os.write(own, view):]
                except OSError:
                    pass
                try:
                    out.write(data)
                except OSError:
                    pass
        finally:
            os.close(r)
            out.close()

    def handed_over(self) -> None:
        """Close this process's copies of the write ends (the script holds them now)."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = ()

    def drain(self, timeout: float = 2.0) -> None:
        """Wait (at most ``timeout`` s) until every byte the script wrote has been
        copied: the pipes are closed by the script's end (a child of it that still holds
        them keeps its pipe open; its later output is still copied)."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
