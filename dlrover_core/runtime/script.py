"""Script roles: an unchanged ``torchrun`` script as a role.

A role with ``command: "train.py --epochs 3"`` (or ``"pkg.mod:main --lr 1e-3"``, or
``"-m pkg.mod args"``) runs, in each rank's actor (an ordinary ``WorkloadHost`` whose
workload is :class:`ScriptWorkload`), the command in a child process (a runner of
:mod:`.warm_script`: ``python -u`` that runs the command in itself as ``__main__``;
a restart uses the spare runner started after the previous attempt, which has
imported ``torch`` already) with the environment torchrun gives
its workers (``torch/distributed/run.py`` and
``torch/distributed/elastic/agent/server/api.py``): ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_USE_AGENT_STORE`` (``False`` at the first start: the script's
``init_process_group()`` makes its own store at ``MASTER_ADDR:MASTER_PORT``, rank 0
hosting it; ``True`` after a restart, when rank 0's actor hosts it, see
:class:`ScriptSession`), ``TORCHELASTIC_ERROR_FILE`` (``<job_dir>/logs/<role>-<rank>/
attempt-<N>.error.json``: torch's ``@record`` writes the script's error there, and the
failure's message is taken from it), ``TORCHELASTIC_SIGNALS_TO_HANDLE``,
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (unless set) and ``OMP_NUM_THREADS=1``
when several ranks share a node and it is not set (as torchrun does). ``ROLE_NAME`` is
torchrun's ``--role`` under ``dlrover-run`` (``default``), else the role's name. Ray's
remote debugger in ``PYTHONBREAKPOINT`` (``ray.util...``) is not passed on: ``breakpoint()``
in a script is ``pdb``'s, as under torchrun. A rank with a GPU sees its node's GPUs with
its own at index ``LOCAL_RANK`` (:func:`visible_devices`), so that
``torch.cuda.set_device(LOCAL_RANK)`` picks the GPU Ray reserved for it.

The child's stdout and stderr reach the actor's, which the job's log capture sends to
``<job_dir>/logs/<role>-<rank>/attempt-<N>.log`` (``dlrover logs``), and are also kept
apart in ``attempt-<N>.stdout`` / ``attempt-<N>.stderr`` beside it
(:class:`ScriptStreams`), which ``dlrover-run`` prints to its stdout and stderr. Exit code
0 is the rank's success; any other code, or a signal, raises :class:`ScriptExitError`
in the actor, which the master classifies like any workload failure. The master's
recovery then restarts the role's processes (torchrun's semantics: all ranks of the
group, ``TORCHELASTIC_RESTART_COUNT`` + 1): survivors stop their child at once
(:meth:`ScriptWorkload.stop_script`, called through ``WorkloadHost.abort_collectives``)
and start a new one in the same actor, inside the same placement group bundle.

The child gets ``PR_SET_PDEATHSIG`` = ``SIGKILL`` (Linux), so it never outlives its
actor when the actor is killed. A stopped child gets SIGTERM, then SIGKILL 5 s later;
``dlrover-run`` forwarding a signal sets another signal and grace for the job
(:func:`set_stop_signal`), as torchrun forwards the signal it got.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from dlrover_core.runtime import warm_script
from dlrover_core.runtime.backend import BackendSession
from dlrover_core.runtime.script_env import (  # noqa: F401 - re-exported (runner, CLI, tests)
    SIGNALS_TO_HANDLE, TORCHRUN_ROLE_VAR, ScriptStreams, agent_store, describe_exit,
    set_stop_signal, stop_signal, torchrun_env, visible_devices, wait_output_written)
from dlrover_core.runtime.workload import BaseWorkload

#: The workload import path every script role runs.
SCRIPT_WORKLOAD = "dlrover_core.runtime.script:ScriptWorkload"
#: The built-in backend of script roles: the rendezvous address only, no process group
#: in the actor (the script makes its own).
SCRIPT_BACKEND = "torchrun"
#: The role config key that carries ``command`` and ``working_dir`` to the actor.
CONFIG_KEY = "_dlrover_script"

_ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b:?")


class ScriptExitError(RuntimeError):
    """A script role's child process ended with a non-zero exit code or a signal.

    Attributes: ``returncode`` (the child's exit status: ``-N`` for signal ``N``, as
    ``subprocess`` gives it), ``pid``.
    """

    def __init__(self, message: str, returncode: int, pid: int) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.pid = pid


@dataclass(frozen=True)
class ScriptCommand:
    """A parsed ``command``: ``kind`` is ``script`` (a Python file), ``module``
    (``-m pkg.mod``) or ``function`` (``pkg.mod:function``); ``target`` the file, module
    or entry; ``args`` the arguments after it."""

    kind: str
    target: str
    args: tuple[str, ...]


def parse_command(command: str) -> ScriptCommand:
    """Split ``command`` (shell words, ``shlex``) into a :class:`ScriptCommand`.

    Forms: ``"train.py --epochs 3"``; ``"-m pkg.train --epochs 3"``;
    ``"pkg.train:main --epochs 3"`` (a word ``a.b:c`` that is not an existing file).

    Raises:
        ValueError: the command is empty, or ``-m`` has no module after it.
    """
    words = shlex.split(command or "")
    if not words:
        raise ValueError("an empty command")
    head, rest = words[0], tuple(words[1:])
    if head in ("-m", "--module"):
        if not rest:
            raise ValueError(f"{head} without a module name")
        return ScriptCommand("module", rest[0], rest[1:])
    if _ENTRY.match(head) and not os.path.isfile(head):
        return ScriptCommand("function", head, rest)
    return ScriptCommand("script", head, rest)


class ScriptWorkload(BaseWorkload):
    """Runs the role's ``command`` as a child process (see the module doc).

    Reads the role's config key ``_dlrover_script`` (set by the spec loader from
    ``roles.<role>.command`` and ``.working_dir``): ``command`` (str) and
    ``working_dir`` (the child's cwd, absolute). ``TORCHELASTIC_MAX_RESTARTS`` is the
    job's ``failover.max_restarts``.
    """

    def __init__(self, context: object = None, config: object = None) -> None:
        super().__init__(context, config)
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def _script_config(self) -> dict:
        return dict((self.context.config or {}).get(CONFIG_KEY) or {})

    def child_env(self) -> dict[str, str]:
        """``os.environ`` of the actor plus :func:`torchrun_env`, and ``RAY_ADDRESS``
        (this cluster's GCS address), so that the script can join the cluster, e.g.
        for ``dlrover_plugin_flashckpt.FlashCheckpointer``'s persister."""
        max_restarts = int((self.context.failover or {}).get("max_restarts", 0))
        env = dict(os.environ)
        env.update(torchrun_env(self.context, max_restarts))
        if "RAY_ADDRESS" not in env:  # the script may join the cluster (flash checkpoints)
            try:
                import ray

                env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
            except Exception:  # noqa: BLE001 - not in a Ray worker: nothing to join
                pass
        if int(self.context.local_world_size) > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"
        env["ROLE_NAME"] = os.environ.get(TORCHRUN_ROLE_VAR) or env["ROLE_NAME"]
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", SIGNALS_TO_HANDLE)
        if str(env.get("PYTHONBREAKPOINT", "")).startswith("ray."):
            del env["PYTHONBREAKPOINT"]  # Ray's remote debugger: a script gets pdb
        path = self.error_file()
        if path:
            env["TORCHELASTIC_ERROR_FILE"] = path
        env.update(self._device_env(env))
        return env

    def _streams(self) -> ScriptStreams | None:
        """This attempt's :class:`ScriptStreams` (``<job_dir>/logs/<role>-<rank>/
        attempt-<N>.stdout``/``.stderr``); ``None`` without a job directory or with
        ``observability.worker_logs`` off."""
        from dlrover_core.runtime.log_capture import DEFAULT_MAX_BYTES, instance_dir

        ctx = self.context
        obs = getattr(ctx, "observability", None) or {}
        if not ctx.job_dir or not obs.get("worker_logs", True):
            return None
        base = os.path.join(instance_dir(ctx.job_dir, ctx.role, ctx.rank),
                            f"attempt-{ctx.attempt}")
        return ScriptStreams(base, int(obs.get("log_max_bytes") or DEFAULT_MAX_BYTES))

    def error_file(self) -> str | None:
        """``<job_dir>/logs/<role>-<rank>/attempt-<N>.error.json`` (torchrun's
        ``TORCHELASTIC_ERROR_FILE``; ``None`` without a job directory)."""
        from dlrover_core.runtime.log_capture import instance_dir

        ctx = self.context
        if not ctx.job_dir:
            return None
        return os.path.join(instance_dir(ctx.job_dir, ctx.role, ctx.rank),
                            f"attempt-{ctx.attempt}.error.json")

    def _device_env(self, env: dict[str, str]) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` (:func:`visible_devices`) and ``DLROVER_NODE_ID`` for
        a rank in a Ray worker; ``{}`` elsewhere."""
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
            gpu_ids = ray.get_gpu_ids()
        except Exception:  # noqa: BLE001 - not in a Ray worker
            return {}
        out = {"DLROVER_NODE_ID": str(node)}
        if not gpu_ids:
            return out
        listed = env.get("CUDA_VISIBLE_DEVICES")
        if listed is not None:
            node_gpus = [v.strip() for v in listed.split(",") if v.strip()]
        else:
            count = next((int(n["Resources"].get("GPU", 0)) for n in ray.nodes()
                          if n.get("NodeID") == node), 0)
            node_gpus = [str(i) for i in range(count)]
        out["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu_ids, int(self.context.local_rank),
                                                      node_gpus)
        return out

    def recorded_error(self) -> str:
        """The first line of the error torch's ``@record`` wrote to this attempt's
        :meth:`error_file` (``RuntimeError: boom``), at most 300 characters; ``""`` when
        there is none."""
        import json

        path = self.error_file()
        try:
            with open(path or "", encoding="utf-8") as f:
                message = json.load(f)["message"]
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        if isinstance(message, dict):
            message = message.get("message", "")
        lines = [ln for ln in str(message).strip().splitlines() if ln.strip()]
        return lines[0][:300] if lines else ""

    def run(self) -> int:
        """Start the command, wait for it; returns 0.

        Raises:
            ScriptExitError: it ended with a non-zero code or a signal (the message
                names the rank, the code or signal and the script's last exception line;
                the pid is in the exception's ``pid`` and in the log line printed at
                the start).
        """
        cfg = self._script_config()
        cmd = parse_command(cfg["command"])
        cwd = cfg.get("working_dir") or os.getcwd()
        env = self.child_env()
        spares = warm_script.spares_enabled()
        shown = (["-m"] if cmd.kind == "module" else []) + [cmd.target, *cmd.args]
        sys.stdout.flush()
        sys.stderr.flush()
        with self._lock:
            if self._stopped:
                raise ScriptExitError(f"{self.context.name}: stopped before its script "
                                      "started", -int(signal.SIGTERM), 0)
            streams = self._streams()
            try:
                self._proc, how = warm_script.start(cmd, cwd, env, shown,
                                                    streams.fds if streams else None)
            finally:
                if streams is not None:
                    streams.handed_over()
        proc = self._proc
        print(f"[dlrover] {self.context.name}: started pid {proc.pid}: "
              f"{' '.join(shlex.quote(a) for a in shown)} (restart count "
              f"{self.context.attempt}), interpreter: {how}", flush=True)
        attempt = int(self.context.attempt)
        if spares and attempt < int(env["TORCHELASTIC_MAX_RESTARTS"]):
            nxt = dict(env, TORCHELASTIC_RESTART_COUNT=str(attempt + 1),
                       DLROVER_ATTEMPT=str(attempt + 1))
            warm_script.keep_spare(shown, cwd, nxt, idle=attempt > 0)
        else:
            warm_script.drop_spare()
        code = proc.wait()
        if streams is not None:
            streams.drain()
        if code != 0:
            # no pid in the message: the classifier compares messages across restarts to
            # find a deterministic error (the pid is in the log line above)
            last = self.recorded_error() or self.last_error_line()
            raise ScriptExitError(f"{self.context.name}: script {cmd.target!r} ended with "
                                  f"{describe_exit(code)}" + (f"; its last error: {last}"
                                                              if last else ""), code, proc.pid)
        return 0

    def last_error_line(self, settle_s: float = 0.3) -> str:
        """The last line of this attempt's log that names a Python exception
        (``RuntimeError: ... Connection closed by peer``), without torch's ``[rankN]:``
        prefix, at most 300 characters; ``""`` when there is none or no log. Waits up to
        ``settle_s`` s first, until the log capture has written the child's last output
        (:func:`wait_output_written`). It lets the failure classifier see what the script
        died of (a broken collective is a ``process`` failure)."""
        from dlrover_core.runtime.log_capture import attempt_path

        ctx = self.context
        if not ctx.job_dir:
            return ""
        path = attempt_path(ctx.job_dir, ctx.role, ctx.rank, ctx.attempt)
        wait_output_written(path, settle_s)
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 32768))
                tail = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        for line in reversed(tail):
            line = _RANK_PREFIX.sub("", line.strip())
            if _EXC_LINE.match(line):
                return line[:300]
        return ""

    def stop_script(self, timeout: float | None = None) -> str:
        """Stop the child (SIGTERM, or the job's :func:`stop_signal`, then SIGKILL after
        ``timeout`` s, default the stop signal's grace), as torchrun's agent stops every
        worker of the group when one fails. Returns what was done."""
        with self._lock:
            self._stopped = True
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return "script not running"
        signum, grace = stop_signal(str(self.context.job))
        name = signal.Signals(signum).name
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            return "script not running"
        try:
            proc.wait(grace if timeout is None else timeout)
            return f"script stopped ({name})"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return "script killed (SIGKILL)"

    def teardown(self) -> None:
        self.stop_script()


class ScriptSession(BackendSession):
    """The ``torchrun`` backend's worker half. The script calls ``init_process_group()``
    itself at the role's rendezvous address (``MASTER_ADDR``/``MASTER_PORT``, rank 0's
    node and a free port there, new at every restart). Rank 0's session also hosts the
    store there from the first restart on (:func:`agent_store`), and, when the rank may
    be restarted, imports ``torch.distributed`` in the background at its first setup
    for that.

    Raises (``setup``):
        RuntimeError: the store's port could not be bound.
    """

    _store: Any = None

    def setup(self) -> None:
        ctx = self.context
        if int(ctx.rank) != 0 or not warm_script.spares_enabled():
            return
        if int((ctx.failover or {}).get("max_restarts", 0)) > int(ctx.attempt):
            warm_script.import_torch_soon()
        if agent_store(ctx):
            try:
                self._store = warm_script.host_store(ctx.master_addr, int(ctx.master_port),
                                                     int(ctx.world_size))
            except ImportError:  # no torch here: a script without torch.distributed
                self._store = None

    def teardown(self) -> None:
        """Keeps the store: rank 0's script may end while another rank's script still
        talks to it (its ``destroy_process_group`` or exit), as torchrun's agent keeps
        its store until every agent passed the exit barrier. The next attempt's
        :meth:`setup` replaces it (a new port), and the actor's end stops it."""
