"""The child side of a script role's warm interpreter (:mod:`.warm_script`).

Started as ``python -u <this file> <fd> [--idle] [--no-preload] -- <command words>``
(the words are there only so that ``ps`` shows what the process runs or will run).
Unless ``--no-preload`` is given (a runner that gets its go message at once) it imports
:func:`preload_names` (``torch`` and ``torch._dynamo``; a module that fails to
import is skipped; the rest is skipped once the go message has arrived), writes
``ready`` to the control socket ``fd`` and waits for one JSON line on it:
``{"env": {...}, "cwd": str, "kind": "script"|"module"|"function", "target": str,
"args": [str]}``. Then it replaces its whole environment by ``env``, changes to ``cwd``,
sets ``sys.argv`` and ``sys.path[0]`` as ``python file``, ``python -m module`` and
``python -c`` would, and runs the command in this process as ``__main__``
(``runpy.run_path`` / ``runpy.run_module``; ``module:function`` is imported and called,
an int it returns being the exit code). The exit code is Python's own: 0 when the
command returns, 1 on an uncaught exception (traceback on stderr), ``sys.exit``'s code.
An empty line or a closed socket instead of the JSON line ends the process with 0
(the spare was not needed).

``--idle``: it runs under ``SCHED_IDLE`` (only CPU time nobody else wants) until the
go message arrives; every thread of the process is then put back to ``SCHED_OTHER``.

This file imports nothing from ``dlrover_core``: the command must find the interpreter
as a plain ``python`` would leave it.
"""

import sys

if __name__ == "__main__" and not sys.flags.safe_path:
    del sys.path[0]  # this file's directory: not the command's sys.path[0]

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402

#: the modules imported before the go message, unless ``DLROVER_WARM_PRELOAD`` (comma-
#: separated module names) says otherwise: ``torch`` and ``torch._dynamo``, which
#: ``DistributedDataParallel``, DTensor and ``torch.compile`` import on first use (about
#: as long as ``import torch`` itself)
PRELOAD = ("torch", "torch._dynamo")
PRELOAD_VAR = "DLROVER_WARM_PRELOAD"


def preload_names() -> list[str]:
    """The modules to import before the go message (see :data:`PRELOAD`)."""
    value = os.environ.get(PRELOAD_VAR)
    names = PRELOAD if value is None else value.split(",")
    return [n.strip() for n in names if n.strip()]


def set_normal_priority() -> None:
    """Every thread of this process back to ``SCHED_OTHER`` (errors ignored)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass


def _receive(sock: socket.socket, box: list, got: threading.Event, idle: bool) -> None:
    buf = b""
    try:
        while not buf.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            buf += chunk
    except OSError:
        buf = b""
    box.append(buf)
    if idle and buf.strip():
        set_normal_priority()
    got.set()


def run_command(go: dict) -> None:
    """Run the command of the go message ``go`` in this process (see the module doc).

    Raises:
        whatever the command raises (``SystemExit`` included).
    """
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in go["env"].items()})
    os.chdir(go["cwd"])
    kind, target, args = go["kind"], go["target"], list(go["args"])
    if kind == "script":
        path0 = os.path.dirname(os.path.abspath(target))
    elif kind == "module":
        path0 = os.getcwd()
    else:
        path0 = ""
    if not sys.flags.safe_path:
        sys.path.insert(0, path0)
    if kind == "script":
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")
    elif kind == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        module, function = target.split(":")
        sys.argv = [module, *args]
        sys.exit(getattr(importlib.import_module(module), function)())


def main() -> None:
    fd = int(sys.argv[1])
    flags = sys.argv[2:sys.argv.index("--")]
    idle = "--idle" in flags
    if idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            idle = False
    sock = socket.socket(fileno=fd)
    box: list = []
    got = threading.Event()
    threading.Thread(target=_receive, args=(sock, box, got, idle), daemon=True).start()
    for name in ([] if "--no-preload" in flags else preload_names()):
        if got.is_set():  # the go message is here: the command imports what it needs
            break
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the command imports it (or fails) itself
            pass
    try:
        sock.sendall(b"ready\n")
    except OSError:
        pass
    got.wait()
    if not box[0].strip():
        os._exit(0)
    go = json.loads(box[0])
    sock.close()
    run_command(go)


if __name__ == "__main__":
    main()
