"""Stacks of a running worker process, for hang diagnosis.

Two ways, both from outside the process being dumped:

- **py-spy** (``pip install dlrover-core[diagnose]``): ``py-spy dump --pid PID
  --nonblocking`` reads the process's memory without stopping it, so it works on a
  process that is stuck in C code or stopped (``SIGSTOP``); it needs ptrace rights
  on the node. The process's live descendants (its ``DataLoader`` worker processes)
  are dumped the same way, after it.
- **faulthandler**: every ``WorkloadHost`` registers :data:`DUMP_SIGNAL` with
  ``faulthandler.register(..., all_threads=True)`` (:func:`register`), writing to
  ``<job dir>/stacks/pid-<pid>.faulthandler.txt``; sending the signal appends the
  stacks of all its threads there. Python's C-level handler runs even while the main
  thread waits in a collective, but a stopped process writes nothing until continued.

:func:`dump_stacks` runs on the node of the process (the master sends it there as a
Ray task) and returns the text.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import time

#: The signal that makes a worker write its stacks (faulthandler).
DUMP_SIGNAL = signal.SIGUSR1

#: s the faulthandler file must stop growing before the dump counts as complete
STABLE_S = 0.5

_registered: dict[str, object] = {}


def faulthandler_path(job_dir: str, pid: int) -> str:
    """Where the worker with ``pid`` writes its stacks on :data:`DUMP_SIGNAL`."""
    return os.path.join(job_dir, "stacks", f"pid-{pid}.faulthandler.txt")


def register(job_dir: str) -> str | None:
    """Register :data:`DUMP_SIGNAL` in this process (once per job directory); returns
    the file, or ``None`` when the directory cannot be written."""
    path = faulthandler_path(job_dir, os.getpid())
    if path in _registered:
        return path
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        f = open(path, "a")  # noqa: SIM115 - kept open: faulthandler writes to its fd
    except OSError:
        return None
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    _registered[path] = f
    return path


def py_spy() -> str | None:
    """The ``py-spy`` executable: beside this Python, else on ``PATH``."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def _py_spy_dump(exe: str, pid: int, timeout_s: float) -> tuple[str, str]:
    """``(stacks, error)`` of ``py-spy dump --pid pid --nonblocking``."""
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--nonblocking"],
                             capture_output=True, text=True, timeout=max(0.1, timeout_s))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "", f"{type(exc).__name__}: {exc}"
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout, ""
    return "", (out.stderr or out.stdout).strip()[-500:]


def _children_stacks(exe: str, pid: int, deadline: float) -> str:
    """py-spy dumps of the live descendants of ``pid`` (its ``DataLoader`` workers,
    say: a rank that waits forever for a batch is only explained by the worker that
    never delivers it), each under a ``# child process`` line, within ``deadline``
    (``time.monotonic()``); a child that is gone or cannot be read is named with why."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return ""
    parts = []
    for child in children:
        try:
            head = f"# child process {child.pid} (parent {child.ppid()}): " \
                   f"{' '.join(child.cmdline())[:200]}"
        except psutil.Error as exc:  # it ended since the listing
            parts.append(f"# child process {child.pid}: {type(exc).__name__}\n")
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            parts.append(f"{head}\n(not dumped: out of time)\n")
            continue
        text, err = _py_spy_dump(exe, child.pid, left)
        parts.append(f"{head}\n{text or err}\n")
    return "".join("\n" + p for p in parts)


def dump_stacks(pid: int, method: str, job_dir: str, timeout_s: float = 10.0) -> dict:
    """The stacks of process ``pid`` on this node; with py-spy also those of its live
    descendant processes (loader workers), appended under ``# child process PID``
    lines (faulthandler: ``pid`` only).

    Args:
        method: ``auto`` (py-spy when found, else faulthandler), ``py-spy`` or
            ``faulthandler``.
        job_dir: where the worker's faulthandler file is.
        timeout_s: the longest wait for py-spy (all its dumps together) or for the
            file to grow.

    Returns:
        ``{"method", "text", "error"}``; ``text`` is empty when nothing came back
        (``error`` says why).
    """
    exe = py_spy() if method in ("auto", "py-spy") else None
    if exe is not None:
        deadline = time.monotonic() + timeout_s
        text, err = _py_spy_dump(exe, pid, timeout_s)
        if text:
            return {"method": "py-spy", "text": text + _children_stacks(exe, pid, deadline),
                    "error": ""}
        if method == "py-spy":
            return {"method": "py-spy", "text": "", "error": err}
    elif method == "py-spy":
        return {"method": "py-spy", "text": "", "error": "py-spy is not installed"}
    path = faulthandler_path(job_dir, pid)
    try:
        start = os.path.getsize(path)
    except OSError:
        return {"method": "faulthandler", "text": "",
                "error": f"{path} does not exist (the worker did not register)"}
    try:
        os.kill(pid, DUMP_SIGNAL)
    except OSError as exc:
        return {"method": "faulthandler", "text": "", "error": f"kill: {exc}"}
    deadline = time.time() + timeout_s
    size, changed = start, time.time()
    while time.time() < deadline:
        time.sleep(0.1)
        new = os.path.getsize(path)
        if new != size:
            size, changed = new, time.time()
        elif new > start and time.time() - changed >= STABLE_S:  # grew, then stopped
            break
    with open(path) as f:
        f.seek(start)
        text = f.read()
    return {"method": "faulthandler", "text": text,
            "error": "" if text else f"no stacks written within {timeout_s:g} s "
                                     "(is the process stopped?)"}
