"""The child side of a script role's warm interpreter (:mod:`.warm_script`).

Started as ``python -u <this file> <fd> [--idle] [--no-preload] -- <command words>``
(the words are there only so that ``ps`` shows what the process runs or will run).
Unless ``--no-preload`` is given (a runner that gets its go message at once) it imports
:func:`preload_names` (``torch`` and ``torch._dynamo``; a module that fails to
import is skipped; the rest is skipped once the go message has arrived), collects
and freezes its heap unless the go message has arrived (``gc.freeze``: no later
collection scans what the imports made), writes ``ready`` to the control socket ``fd``
and waits for one JSON line on it:
``{"env": {...}, "cwd": str, "kind": "script"|"module"|"function", "target": str,
"args": [str]}``. Then it replaces its whole environment by ``env``, changes to ``cwd``,
sets ``sys.argv`` and ``sys.path[0]`` as ``python file``, ``python -m module`` and
``python -c`` would, and runs the command in this process as ``__main__``
(:func:`run_script`, with an absolute ``__file__``, / ``runpy.run_module``;
``module:function`` is imported and called,
an int it returns being the exit code). The exit code is Python's own: 0 when the
command returns, 1 on an uncaught exception (traceback on stderr), ``sys.exit``'s code.

The process then ends as :mod:`multiprocessing`'s children do (:func:`finish`): it
joins the non-daemon threads, runs the ``atexit`` handlers, flushes every open Python
file, and leaves with ``os._exit`` instead of tearing the interpreter down. The
teardown is where torch's gloo backend (2.13 on CPU) aborts with "terminate called
without an active exception" after a 2-rank script has finished its work and called
``destroy_process_group`` (8 of 49 runs of a plain 2-process gloo script, no dlrover,
on a 2-core machine; with or without DDP and ``destroy_process_group``, with a TCP or
a file store), 0 of 60 when the script ended this way; through this runner 4 of 40
before, 0 of 40 after.
An empty line or a closed socket instead of the JSON line ends the process with 0
(the spare was not needed). A go message that starts with :data:`STREAMS_MARK` comes
with two file descriptors (``socket.send_fds``): they become the command's stdout and
stderr (file descriptors 1 and 2) before it starts.

``--idle``: it runs under ``SCHED_IDLE`` (only CPU time nobody else wants) until the
go message arrives; every thread of the process is then put back to ``SCHED_OTHER``.

This file imports nothing from ``dlrover_core``: the command must find the interpreter
as a plain ``python`` would leave it.
"""

import sys

if __name__ == "__main__" and not sys.flags.safe_path:
    del sys.path[0]  # this file's directory: not the command's sys.path[0]

import atexit  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.machinery  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

#: the modules imported before the go message, unless ``DLROVER_WARM_PRELOAD`` (comma-
#: separated module names) says otherwise: ``torch`` and ``torch._dynamo``, which
#: ``DistributedDataParallel``, DTensor and ``torch.compile`` import on first use (about
#: as long as ``import torch`` itself)
PRELOAD = ("torch", "torch._dynamo")
PRELOAD_VAR = "DLROVER_WARM_PRELOAD"
#: the byte a go message starts with when it carries two file descriptors (the
#: command's stdout and stderr, ``socket.send_fds``)
STREAMS_MARK = b"F"


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
    fds: list[int] = []
    try:
        while not buf.endswith(b"\n"):
            chunk, new_fds, _flags, _addr = socket.recv_fds(sock, 65536, 2)
            fds += new_fds
            if not chunk:
                break
            buf += chunk
    except OSError:
        buf = b""
    if buf.startswith(STREAMS_MARK):  # the go message came with stdout and stderr
        buf = buf[len(STREAMS_MARK):]
    box.append(buf)
    box.append(fds)
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
        run_script(target)
    elif kind == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        module, function = target.split(":")
        sys.argv = [module, *args]
        sys.exit(getattr(importlib.import_module(module), function)())


def run_script(target: str) -> None:
    """Run the file ``target`` as ``python target`` runs it: ``__main__`` with an
    absolute ``__file__`` (as Python >= 3.9 gives it; ``runpy.run_path`` would give
    ``target`` as written) while ``sys.argv[0]`` stays as written. A directory or a zip
    file with a ``__main__.py`` runs through ``runpy.run_path``."""
    import builtins
    import types

    path = os.path.abspath(target)
    if not os.path.isfile(path) or path.endswith((".zip", ".pyz")):
        runpy.run_path(target, run_name="__main__")
        return
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    loader = importlib.machinery.SourceFileLoader("__main__", path)
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                         __loader__=loader, __spec__=None, __package__=None)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``, as the interpreter computes it: ``None``
    is 0, an int is itself, anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _flush_open_files() -> None:
    """Flush every open Python file object (the interpreter's teardown would close
    them, writing what they buffer); errors are ignored, as the teardown ignores them."""
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, and some objects
        # warn on any attribute read (torch.distributed.reduce_op: a FutureWarning)
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:  # noqa: BLE001 - a broken file must not stop the exit
                pass


def finish(command) -> None:
    """Run ``command()`` as the interpreter runs ``__main__`` and end the process with
    its exit status, the way :mod:`multiprocessing` ends a child process: uncaught
    exceptions go to ``sys.excepthook`` (status 1), non-daemon threads are joined
    (``threading._shutdown``), ``atexit`` handlers run, open files and stdio are
    flushed, then ``os._exit``: the interpreter's teardown (module globals cleared,
    C++ static objects destroyed) is skipped. Never returns."""
    code = 0
    try:
        command()
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + 2       # as a shell reports a process ended by SIGINT
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # what the interpreter does first when main() ends
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
    except Exception:  # noqa: BLE001 - atexit prints a failed handler itself
        pass
    _flush_open_files()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


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
    if not got.is_set():  # spare: what the imports made leaves every later collection
        gc.collect()      # (dlrover_core.runtime.warming.freeze_heap: 0.1-0.2 s per full one)
        gc.freeze()
    try:
        sock.sendall(b"ready\n")
    except OSError:
        pass
    got.wait()
    if not box[0].strip():
        os._exit(0)
    go = json.loads(box[0])
    sock.close()
    if len(box[1]) == 2:  # the command's stdout and stderr, given with the go message
        for fd, target in zip(box[1], (1, 2)):
            os.dup2(fd, target)
            os.close(fd)
    finish(lambda: run_command(go))


if __name__ == "__main__":
    main()
