"""A private ``redis-server`` process for tests and examples.

Starts Debian's ``redis-server`` binary on a free loopback port with its own data
directory and the append-only file on (``appendfsync always``), so a stopped and
restarted server keeps its streams and consumer groups. Never touches a system
Redis.

Example::

    with LocalRedisServer() as server:
        client = server.client()
        ...
        server.stop(); server.start()    # broker down and back on the same port
        server.kill(); server.start()    # SIGKILLed, restarted on its append-only file
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any, Self

from dlrover_core.ports import free_port


class LocalRedisServer:
    """One ``redis-server`` child process.

    Args:
        port: TCP port on 127.0.0.1 (default: a free one).
        data_dir: its working directory (default: a new temp dir, removed by
            :meth:`cleanup`).
        binary: the ``redis-server`` executable.

    Raises:
        FileNotFoundError: no ``redis-server`` on ``PATH`` (``apt-get install redis-server``).
    """

    def __init__(self, port: int | None = None, data_dir: str | None = None,
                 binary: str = "redis-server") -> None:
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(f"{binary!r} is not on PATH; install Debian's package: "
                                    "apt-get install redis-server")
        self.binary = path
        self.port = port or free_port()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="odl-redis-")
        os.makedirs(self.data_dir, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> Self:
        """Start the server and wait until it answers ``PING``."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", self.data_dir, "--appendonly", "yes", "--appendfsync", "always",
                "--save", "", "--daemonize", "no", "--protected-mode", "yes",
                "--logfile", os.path.join(self.data_dir, "redis.log")]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with "
                                   f"{self.proc.returncode}; see {self.data_dir}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server on port {self.port} did not answer within {timeout_s} s")

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop the server (SIGTERM: it flushes the append-only file) and wait."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL the server (no flush: what the append-only file holds, with
        ``appendfsync always`` every write acknowledged to a client, is what a
        restart finds) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc = None

    def client(self, **kwargs: Any) -> Any:
        """A ``redis.Redis`` connected to this server (needs redis-py)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
