"""Warm interpreters for script roles: a restart skips the interpreter's start and
``import torch``.

Every attempt of a script role's rank runs its command in a *runner*
(:mod:`.script_runner`): a ``python -u`` process that may import modules first
(``torch`` and ``torch._dynamo``, which DDP imports on first use; the variable
``DLROVER_WARM_PRELOAD`` names others, comma-separated) and waits for a go message
carrying the environment, working directory and command, then runs the command as
``__main__`` in itself. When the rank may still be restarted (its restart
count is below ``failover.max_restarts``), the actor also starts a *spare* runner for
the next attempt right after the current one starts; the spare imports ``torch`` and
waits. A restart in the same actor hands the spare the new attempt's go message, so the
new script starts with those modules imported; without a fitting spare a new runner is
started without imports and given the go message at once.

A spare fits when the new attempt's environment differs from the one it was started
with only in :data:`PER_ATTEMPT_KEYS` (the variables torchrun sets per worker and
attempt, and dlrover's own): other variables (``OMP_NUM_THREADS``,
``CUDA_VISIBLE_DEVICES``, ...) may be read while ``torch`` is imported, so a spare
started under other values is stopped and not used.

Priority: the first spare (started with attempt 0) runs at normal priority, beside the
script's own start; a spare started after a restart runs under ``SCHED_IDLE`` until it
is used, when this process may return a thread from ``SCHED_IDLE`` to ``SCHED_OTHER``
(:func:`can_leave_idle`; root with ``CAP_SYS_NICE``, or ``RLIMIT_NICE`` >= 20), so that
it does not slow the restarted group; otherwise at normal priority.

``DLROVER_WARM_RESTART=0`` in the actor's environment (the role's ``env``) turns
spares off (the runners stay). The processes get ``PR_SET_PDEATHSIG`` = ``SIGKILL``:
a spare never outlives its actor. They start with no signal blocked, whatever the
starting thread blocks (a Ray worker's thread blocks SIGINT), as torchrun's workers do. Each runner leads a session of its own, as torchrun's
workers do.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

#: the environment variables a spare may see change between its start and its go
PER_ATTEMPT_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
    "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "DLROVER_JOB", "DLROVER_ROLE", "DLROVER_ATTEMPT"})
#: the variable that turns spares off (``"0"``) or on (``"1"``, the default)
SWITCH = "DLROVER_WARM_RESTART"
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "script_runner.py")


def die_with_parent() -> None:  # runs in the child between fork and exec
    """The runner's start (between fork and exec): no signal blocked, as torchrun's
    workers start (a child inherits its forking thread's mask, and a Ray worker's
    thread blocks SIGINT: a forwarded SIGINT stayed pending until the SIGKILL), and
    ``PR_SET_PDEATHSIG`` = ``SIGKILL``."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the teardown still kills the child
        pass


def spares_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether ``DLROVER_WARM_RESTART`` (in ``env``, default ``os.environ``) allows
    spares.

    Raises:
        ValueError: the variable is set to something other than ``0`` or ``1``.
    """
    value = (os.environ if env is None else env).get(SWITCH, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH}={value!r}: allowed are '0' (no spare interpreter) "
                         "and '1' (default)")
    return value == "1"


_leave_idle: bool | None = None


def can_leave_idle() -> bool:
    """Whether a thread of this process may go from ``SCHED_IDLE`` back to
    ``SCHED_OTHER`` (tried once, in a short-lived thread; the answer is kept)."""
    global _leave_idle
    if _leave_idle is None:
        result: list[bool] = []

        def probe() -> None:
            try:
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
                result.append(True)
            except (OSError, AttributeError):
                result.append(False)

        t = threading.Thread(target=probe, name="dlrover-sched-probe")
        t.start()
        t.join()
        _leave_idle = bool(result and result[0])
    return _leave_idle


class Runner:
    """One runner process (see the module doc) and its control socket.

    Args: ``shown`` (words shown on its command line), ``cwd``, ``env`` (its
    environment until the go message), ``idle`` (start under ``SCHED_IDLE``),
    ``preload`` (import the modules of ``script_runner.preload_names`` first; off for a
    runner that gets its go message at once).
    """

    def __init__(self, shown: list[str], cwd: str, env: dict[str, str],
                 idle: bool = False, preload: bool = True) -> None:
        parent, child = socket.socketpair()
        flags = (["--idle"] if idle else []) + ([] if preload else ["--no-preload"])
        argv = [sys.executable, "-u", RUNNER, str(child.fileno()), *flags, "--", *shown]
        try:
            # a session of its own, as torchrun starts each worker (start_new_session):
            # with the kernel's autogroups (sched_autogroup_enabled) the CPU is shared
            # between sessions first, and a rank in the session of its actor, the Raylet
            # and the JobMaster ran at 0.91x torchrun's steps/s on 2 cores (issue 51)
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, pass_fds=(child.fileno(),),
                                         preexec_fn=die_with_parent, start_new_session=True)
        finally:
            child.close()
        self.sock = parent
        self.env = dict(env)
        self._ready = False

    def ready(self) -> bool:
        """Whether it has imported its modules (non-blocking)."""
        if not self._ready:
            try:
                self._ready = self.sock.recv(64, socket.MSG_DONTWAIT).startswith(b"ready")
            except (BlockingIOError, OSError):
                pass
        return self._ready

    def fits(self, env: dict[str, str]) -> bool:
        """Whether it is alive and ``env`` differs from its start environment only in
        :data:`PER_ATTEMPT_KEYS`."""
        if self.proc.poll() is not None:
            return False
        keys = (set(env) | set(self.env)) - PER_ATTEMPT_KEYS
        return all(env.get(k) == self.env.get(k) for k in keys)

    def go(self, env: dict[str, str], cwd: str, kind: str, target: str,
           args: list[str], streams: tuple[int, int] | None = None) -> subprocess.Popen:
        """Send the go message; returns the process, which now runs the command.
        ``streams``: file descriptors (stdout, stderr) the command writes to instead of
        the runner's own (sent with the message, ``socket.send_fds``).

        Raises:
            OSError: the runner is gone (its socket is closed).
        """
        msg = {"env": env, "cwd": cwd, "kind": kind, "target": target, "args": list(args)}
        payload = json.dumps(msg).encode() + b"\n"
        if streams is not None:
            from dlrover_core.runtime.script_runner import STREAMS_MARK

            socket.send_fds(self.sock, [STREAMS_MARK], list(streams))
        self.sock.sendall(payload)
        self.sock.close()
        return self.proc

    def discard(self) -> None:
        """Stop it (unused): close its socket, SIGKILL, reap."""
        try:
            self.sock.close()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()


_spare: Runner | None = None
_spare_lock = threading.Lock()


def start(cmd: Any, cwd: str, env: dict[str, str], shown: list[str],
          streams: tuple[int, int] | None = None) -> tuple[Any, str]:
    """Run ``cmd`` (a ``ScriptCommand``) with ``env`` in ``cwd``: in this actor's spare
    when it fits, else in a new runner; ``streams``: the command's stdout and stderr
    (file descriptors; default the runner's, this process's). Returns ``(Popen, how)``,
    ``how`` being ``"warm"`` (a spare that had imported its modules), ``"warming"`` (a
    spare still importing) or ``"new"``.

    Raises:
        OSError: a new runner could not be started.
    """
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        if spare.fits(env):
            how = "warm" if spare.ready() else "warming"
            try:
                return spare.go(env, cwd, cmd.kind, cmd.target, list(cmd.args),
                                streams), how
            except OSError:
                pass
        spare.discard()
    new = Runner(shown, cwd, env, preload=False)
    return new.go(env, cwd, cmd.kind, cmd.target, list(cmd.args), streams), "new"


def keep_spare(shown: list[str], cwd: str, env: dict[str, str], idle: bool) -> None:
    """Start this actor's spare runner with ``env`` (the next attempt's expected
    environment), replacing an unused one; ``idle``: under ``SCHED_IDLE`` when
    :func:`can_leave_idle`."""
    global _spare
    new = Runner(shown, cwd, env, idle=idle and can_leave_idle())
    with _spare_lock:
        old, _spare = _spare, new
    if old is not None:
        old.discard()


def drop_spare() -> None:
    """Stop this actor's spare runner, if any."""
    global _spare
    with _spare_lock:
        old, _spare = _spare, None
    if old is not None:
        old.discard()


# ---------------------------------------------------------------------- the store
_torch_import: threading.Thread | None = None


def import_torch_soon() -> None:
    """Import ``torch.distributed`` in a background thread of this process (once), so
    that :func:`host_store` finds it imported at the first restart."""
    global _torch_import
    if _torch_import is None:
        def work() -> None:
            try:
                import torch.distributed  # noqa: F401
            except Exception:  # noqa: BLE001 - no torch: host_store says so
                pass

        _torch_import = threading.Thread(target=work, name="dlrover-torch-import",
                                         daemon=True)
        _torch_import.start()


def host_store(addr: str, port: int, world_size: int, timeout_s: float = 300.0) -> Any:
    """A ``torch.distributed.TCPStore`` server on ``port`` (``addr`` is this node's
    address, which its own client connection uses) for ``world_size`` clients, not
    waiting for them: the rendezvous store that a script role's rank 0 actor hosts from
    the first restart on, as torchrun's agent does (``TORCHELASTIC_USE_AGENT_STORE=
    True``: every rank's ``init_process_group()`` is a client, so no rank waits for
    another's script to start the server, which cost a client 0.4-0.7 s of torch's
    connect back-off in a test here). The server stops when the returned object is
    dropped. Waits for :func:`import_torch_soon`.

    Raises:
        ImportError: torch is not installed.
        RuntimeError: the port could not be bound (torch's error).
    """
    import datetime

    if _torch_import is not None:
        _torch_import.join()
    from torch.distributed import TCPStore

    return TCPStore(addr, port, world_size, True,
                    datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
