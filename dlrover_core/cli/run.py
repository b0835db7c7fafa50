"""``dlrover-run``: torchrun's command line, run as a dlrover job.

    dlrover-run [torchrun's options] train.py [script args]
    dlrover-run [torchrun's options] -m pkg.train [script args]

The options are parsed by torch's own ``torch.distributed.run.get_args_parser()``, so
every torchrun flag is accepted (given on the line or, as torchrun reads them, through
``PET_<NAME>`` environment variables), plus DLRover's own ``dlrover-run`` flags; the job
is one script role ``trainer`` (see :mod:`dlrover_core.runtime.script`) of ``--nnodes`` x
``--nproc-per-node`` ranks, run on the Ray cluster (an embedded one unless ``--address``
is given). docs/torchrun.md has the table of every option and what it does here; in
short:

- honoured: ``--nnodes N`` / ``MIN:MAX`` (an elastic role, docs/elastic.md),
  ``--nproc-per-node`` (an integer; ``cpu``, ``gpu``, ``auto`` counted on the cluster's
  nodes), ``--max-restarts``, ``--rdzv-id`` (the job name and ``TORCHELASTIC_RUN_ID``),
  ``-m``, ``--role`` (``ROLE_NAME``), ``--signals-to-handle``, ``--shutdown-timeout``.
- a line written for several nodes is run once, on a Ray cluster: ``--node-rank`` 0
  only (others are refused with that advice); ``--rdzv-endpoint HOST:PORT`` /
  ``--master-addr HOST`` (not this machine) need ``--address`` (or ``RAY_ADDRESS``), and
  without it are refused with the advice ``--address HOST:6379``; ``--master-port`` and
  ``--rdzv-conf`` have nothing to do (the master picks the rendezvous).
- accepted, nothing to do: ``--standalone``, ``--rdzv-backend static|c10d``,
  ``--monitor-interval``, ``--start-method spawn``, ``--local-addr``.
- any other option set to something other than its default (``--no-python``,
  ``--log-dir``, ``--tee`` ...) is refused before anything starts, with an error naming
  it, its value (and the ``PET_*`` variable it came from) and why.

GPUs: ``--nproc-per-node gpu`` (or ``auto`` on a cluster with GPUs, or ``--accelerator
nvidia.com/gpu``) reserves one GPU per rank through Ray, and with ``--nnodes N`` puts the
N node groups on N distinct nodes (``node_num``); each rank's script sees its node's GPUs
with its own at index ``LOCAL_RANK`` (:func:`dlrover_core.runtime.script.visible_devices`).

Signals (as torchrun): SIGTERM, SIGINT, SIGHUP and SIGQUIT (``--signals-to-handle``)
are forwarded to every rank's script, which gets SIGKILL ``--shutdown-timeout`` s later
(default 30); dlrover-run then exits 1. ``--detach`` (with ``--address``): Ctrl-C leaves
the job running instead.

The default job name is :func:`default_job_name`: stable across submits of the same
script, so a resubmit is the same job (``runs/<name>``).

dlrover-run's own options: ``--address``, ``--job-dir`` (default ``runs/<job name>``),
``--cpus-per-rank`` (default ``min(1, CPUs of this machine / ranks per node)``),
``--quiet`` (the ranks' output only in the job's log files), ``--detach``.

Output (as torchrun): each rank's stdout goes to dlrover-run's stdout and its stderr to
its stderr, unlabelled (:class:`RankOutput`); dlrover-run's own lines (the summary, where
the job directory is) go to stderr, so ``dlrover-run ... > out.txt`` holds what the
scripts printed. Each rank's output is also in its log (``dlrover logs``).

Exit code: the job's, through the table ``dlrover submit`` uses
(:data:`dlrover_core.spec.builder.EXIT_CODES`): 0 when the job succeeded, 1 when it failed
or was stopped (a forwarded signal included, as torchrun); 2 for bad input (nothing
started) and 3 when another run holds the job directory or the checkpoint folder, or a
job of that name runs on the cluster.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Sequence

from dlrover_core.cli.run_options import (  # noqa: F401 - re-exported (tests)
    RAY_HEAD_PORT, UsageError, build_parser, check_options, cluster_devices, default_job_name,
    dlrover_flags, job_spec, meeting_place, parse_nnodes)

#: the signals forwarded to the ranks unless ``--signals-to-handle`` says otherwise
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
#: seconds a rank has between the forwarded signal and its SIGKILL when
#: ``--shutdown-timeout`` is not given (torchrun's own default)
SHUTDOWN_TIMEOUT_S = 30.0
#: exit code after a forwarded signal, as torchrun's (it exits 1 on a SignalException)
SIGNAL_EXIT = 1


class Signalled(BaseException):
    """A forwarded signal ended the wait for the job (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def handled_signals(args: argparse.Namespace) -> list[signal.Signals]:
    """``--signals-to-handle`` (torchrun's, default ``SIGTERM,SIGINT,SIGHUP,SIGQUIT``)
    as signals; ``--detach`` leaves SIGINT to Python (Ctrl-C detaches).

    Raises:
        UsageError: a name that is not a signal of this platform.
    """
    out = []
    for name in str(args.signals_to_handle or SIGNALS).split(","):
        name = name.strip()
        if not name:
            continue
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise UsageError(f"--signals-to-handle={args.signals_to_handle!r}: {name!r} is "
                             "not a signal; allowed: names such as SIGTERM,SIGINT") from None
        if sig == signal.SIGINT and args.detach:
            continue
        out.append(sig)
    return out


def shutdown_timeout(args: argparse.Namespace) -> float:
    """``--shutdown-timeout`` in s (torchrun's; default :data:`SHUTDOWN_TIMEOUT_S`).

    Raises:
        UsageError: not a number >= 0.
    """
    value = args.shutdown_timeout
    if value is None:
        return SHUTDOWN_TIMEOUT_S
    try:
        out = float(value)
    except ValueError:
        out = -1.0
    if not out >= 0:
        raise UsageError(f"--shutdown-timeout={value!r}: allowed: seconds, a number >= 0")
    return out


def _on_signal(signum: int, frame: Any) -> None:
    if not getattr(_on_signal, "fired", False):  # the first one stops the job; later
        _on_signal.fired = True                   # ones arrive while it stops
        raise Signalled(signum)


def install_handlers(signals: list[signal.Signals]) -> dict:
    """Make :func:`_on_signal` the handler of ``signals`` (after ``ray.init``, whose own
    handlers it replaces). Returns the previous handlers."""
    _on_signal.fired = False
    return {sig: signal.signal(sig, _on_signal) for sig in signals}


def forward_signal(name: str, signum: int, grace_s: float, err: Any) -> dict | None:
    """Stop job ``name`` after a signal: each rank's script gets ``signum``, then SIGKILL
    after ``grace_s`` s (:mod:`dlrover_core.runtime.script` reads both from Ray's internal
    key-value store, :func:`dlrover_core.runtime.script.set_stop_signal`). Returns the
    job's summary (``None`` when the master never started)."""
    import ray

    from dlrover_core.master.client import get_master
    from dlrover_core.runtime.script import set_stop_signal

    err.print(f"dlrover-run: got {signal.Signals(signum).name}: forwarding it to every "
              f"rank (SIGKILL after {grace_s:g} s)", highlight=False, markup=False)
    set_stop_signal(name, signum, grace_s)
    master = get_master(name)
    if master is None:
        return None
    master.stop.remote()
    try:
        return ray.get(master.wait.remote(grace_s + 60), timeout=grace_s + 90)
    finally:
        try:
            ray.kill(master, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


class RankOutput:
    """The ranks' stdout on this process's stdout and their stderr on its stderr, as
    torchrun leaves them (no labels): the ``<job_dir>/logs/<role>-<rank>/attempt-<N>.stdout``
    and ``.stderr`` files (:class:`dlrover_core.runtime.script.ScriptStreams`), whole
    lines at a time, polled every ``poll_s`` s by a thread. What those files held before
    :meth:`start` (an earlier run's) is not printed."""

    SUFFIXES = {".stdout": 1, ".stderr": 2}

    def __init__(self, job_dir: str, poll_s: float = 0.1) -> None:
        import threading

        self.job_dir, self.poll_s = job_dir, poll_s
        self._at: dict[str, tuple[int, int]] = {}  # path -> (inode, bytes read)
        self._partial: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dlrover-run-output",
                                        daemon=True)

    def _files(self) -> list[str]:
        import glob

        found = glob.glob(os.path.join(glob.escape(self.job_dir), "logs", "*", "attempt-*.std*"))
        return sorted(p for p in found if os.path.splitext(p)[1] in self.SUFFIXES)

    def start(self) -> None:
        for path in self._files():  # an earlier run's output
            try:
                st = os.stat(path)
            except OSError:
                continue
            self._at[path] = (st.st_ino, st.st_size)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self, final: bool = False) -> None:
        """Print what the files gained since the last poll (``final``: the last
        unterminated lines too)."""
        for path in self._files():
            try:
                st = os.stat(path)
                ino, done = self._at.get(path, (st.st_ino, 0))
                if ino != st.st_ino or st.st_size < done:  # a new file in its place
                    done = 0
                with open(path, "rb") as f:
                    f.seek(done)
                    data = f.read()
            except OSError:
                continue
            self._at[path] = (st.st_ino, done + len(data))
            data = self._partial.pop(path, b"") + data
            cut = len(data) if final else data.rfind(b"\n") + 1
            if cut < len(data):
                self._partial[path] = data[cut:]
            if cut:
                self._write(self.SUFFIXES[os.path.splitext(path)[1]], data[:cut])

    @staticmethod
    def _write(fd: int, data: bytes) -> None:
        stream = sys.stdout if fd == 1 else sys.stderr
        try:
            stream.flush()
            stream.buffer.write(data)
            stream.buffer.flush()
        except (AttributeError, ValueError):  # a stream without bytes (a test's capture)
            stream.write(data.decode("utf-8", "replace"))
            stream.flush()
        except OSError:
            pass

    def finish(self) -> None:
        """Stop polling and print the rest."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.poll(final=True)


def _error(err: Any, exc: object) -> None:
    """``error: <exc>``: the text printed as it is (no rich markup in it)."""
    from rich.markup import escape

    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)


def main(argv: Sequence[str] | None = None) -> int:
    from dlrover_core.cli.output import console_for
    from dlrover_core.spec.errors import SpecError

    err = console_for(stderr=True)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # argparse's own errors: usage on stderr, exit 2
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        check_options(parser, args)
        place = meeting_place(parser, args)
        signals = handled_signals(args)
        grace = shutdown_timeout(args)
        address = args.address
        if address is None and place is not None and not os.environ.get("RAY_ADDRESS"):
            raise UsageError(
                f"this line names {place!r} as the place to meet (--rdzv-endpoint, "
                "--master-addr or their PET_* variables): dlrover-run runs it once, on a "
                "Ray cluster; give the Ray head's address, e.g. --address "
                f"{place}:{RAY_HEAD_PORT} (Ray's default port), or run it on a node of "
                "the cluster with RAY_ADDRESS set")
        dlrover_flags(args, *parse_nnodes(args.nnodes))  # bad values: before Ray starts
        needs_cluster = str(args.nproc_per_node) in ("gpu", "auto") or \
            args.accelerator is not None
        spec_dict = job_spec(args) if not needs_cluster else None
    except (UsageError, SpecError) as exc:
        _error(err, exc)
        return 2
    return _run(args, parser, err, spec_dict, address, signals, grace)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser, err: Any,
         spec_dict: dict | None, address: str | None, signals: list, grace: float) -> int:
    import ray

    from dlrover_core.cli.progress import print_summary
    from dlrover_core.master.client import init_ray, submit_job
    from dlrover_core.master.dir_lock import DirInUseError, DirLock
    from dlrover_core.spec.builder import EXIT_CODES  # the table of `dlrover submit`
    from dlrover_core.spec.errors import SpecError
    from dlrover_core.spec.loader import load_spec

    spec = job_dir = output = None
    try:
        if spec_dict is not None:  # bad input and a busy job directory: before Ray starts
            spec = load_spec(spec_dict)
            job_dir = os.path.abspath(args.job_dir or os.path.join("runs", spec.name))
            with DirLock(job_dir, "job directory", spec.name):
                pass
    except (UsageError, SpecError) as exc:
        _error(err, exc)
        return 2
    except DirInUseError as exc:
        _error(err, exc)
        return 3
    try:
        started_here = init_ray(address)
    except Exception as exc:  # noqa: BLE001 - a bad --address, a refused token
        _error(err, f"cannot start or join Ray (--address={address!r}): {exc}")
        return 2
    previous = install_handlers(signals)
    try:
        if spec is None:
            try:
                spec = load_spec(job_spec(args, cluster_devices()))
            except (UsageError, SpecError) as exc:
                _error(err, exc)
                return 2
            job_dir = os.path.abspath(args.job_dir or os.path.join("runs", spec.name))
        from dlrover_core.runtime.script import set_stop_signal

        set_stop_signal(spec.name, None)
        output = None if args.quiet else RankOutput(job_dir)
        if output is not None:
            output.start()
        try:
            summary = submit_job(spec, address=address, job_dir=job_dir, progress=False,
                                 verbose=False)
        except Signalled as sig:
            summary = forward_signal(spec.name, sig.signum, grace, err)
            if summary is not None:
                print_summary(summary, console=err)
            return SIGNAL_EXIT
        except KeyboardInterrupt:  # --detach: submit_job detached (or stopped) the job
            return 130
        except DirInUseError as exc:
            _error(err, exc)
            return 3
        except RuntimeError as exc:  # a job of that name is already running
            if "already running" not in str(exc):
                raise
            _error(err, exc)
            return 3
    finally:
        if output is not None:
            output.finish()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if started_here and ray.is_initialized():
            ray.shutdown()
    if summary is None:
        err.print("the job ended without a summary", highlight=False, markup=False)
        return 1
    print_summary(summary, console=err)
    err.print(f"job directory: {job_dir}  (logs: dlrover logs {spec.name} --job-dir "
              f"{job_dir})", highlight=False, markup=False)
    return EXIT_CODES.get(summary.get("status"), 1)


if __name__ == "__main__":
    sys.exit(main())
