"""Replica bytes over one TCP connection: from the source node's slot straight into
the holder's replica buffer (``checkpoint.options.replicas``, :mod:`.replica`).

The Ray object path copies a save three times (into the source's object store, the
object transfer between the raylets, out of the holder's store into its buffer)
and moves it in the object manager's chunks; this one ``sendall``\\ s the slot's data
area from the persister's mapping of the slot (no copy in the source's user space: the
kernel copies the mapped pages into the socket's buffers) and the holder
``recv_into``\\ s its mapped buffer (the way a parameter server or NCCL's socket
transport moves tensors between hosts; across machines the NIC bounds it). A
``sendfile(2)`` of the slot's file moved 1.8-2.0 GiB/s over loopback on this
project's 2-core VM where ``sendall`` from a filled mapping of the same file moved
3.4-4.2 GiB/s (512 MiB, interleaved, 2026-12-01), so the mapping is sent.

Protocol (one connection per replica; the source listens, the holder connects, so
only the source's port needs to be reachable):

1. the source binds an ephemeral port on its node's IP and asks the holder's
   persister to :meth:`pull <.replica.ReplicaHolder.pull>` from it, with a
   16-byte random token;
2. the holder connects and sends the token; the source compares it (a connection
   with another token is closed, the source keeps waiting until its deadline);
3. the source sends the ``data_len`` bytes of its slot; the holder, once it holds the
   last byte, sends one acknowledgement byte (:data:`ACK`);
4. after the acknowledgement the source sends one verdict byte: ``1`` when the slot's
   sequence number did not move while it was sent, ``0`` when a save overwrote it
   meanwhile (the holder then leaves the buffer not READY: a torn replica is never
   listed or loaded). The verdict is taken after the acknowledgement, when every byte
   the holder keeps has been read from the slot.

Imports no torch; Ray only in :func:`send_over_tcp`.
"""

from __future__ import annotations

import hmac
import os
import socket
import time
from typing import Any, Callable

TOKEN_BYTES = 16
#: the holder's byte after it received the whole replica
ACK = b"\x06"
#: bytes per ``recv_into`` at most
RECV_CHUNK = 16 << 20
#: socket buffer sizes asked for (the kernel may cap them)
SOCKET_BUFFER = 8 << 20
#: seconds the holder tries to connect before the source falls back to Ray
CONNECT_TIMEOUT_S = 10.0


class StreamError(RuntimeError):
    """The replica stream failed (no connection, a short read, a bad token)."""


def new_token() -> bytes:
    return os.urandom(TOKEN_BYTES)


def listen(host: str) -> socket.socket:
    """A listening TCP socket on ``host``, an ephemeral port."""
    srv = socket.create_server((host, 0), backlog=4)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    return srv


def send(srv: socket.socket, token: bytes, data: memoryview,
         verdict: Callable[[], bool], timeout_s: float = 60.0,
         gave_up: Callable[[], bool] = lambda: False,
         timings: dict | None = None) -> bool:
    """Serve one replica on the listening ``srv``: accept the holder's connection
    (closing any that sends another token), send ``data`` (``sendall``: a view of the
    slot's mapping, no user-space copy), wait for the holder's acknowledgement of the
    last byte, then send the verdict byte of ``verdict()`` (called after the
    acknowledgement). Returns the verdict.

    ``gave_up()`` is polled while waiting for the connection (the holder's call
    failed: stop waiting). ``timings``, when given, gets ``connect_s`` (from the call
    until the holder's token was accepted) and ``stream_s`` (from the first byte sent
    until the acknowledgement), in s.

    Raises:
        StreamError: no connection with the token within ``timeout_s`` s, or the
            connection broke, or the holder did not acknowledge the bytes.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    srv.settimeout(0.2)
    while True:
        if time.monotonic() > deadline or gave_up():
            raise StreamError(f"no holder connected with the token within {timeout_s} s")
        try:
            conn, _ = srv.accept()
        except socket.timeout:
            continue
        conn.settimeout(timeout_s)
        try:
            got = _recv_exact(conn, TOKEN_BYTES)
        except (OSError, StreamError):
            conn.close()
            continue
        if not hmac.compare_digest(got, token):
            conn.close()
            continue
        break
    try:  # the connection has the listening socket's send buffer size
        t1 = time.monotonic()
        conn.sendall(data)
        try:
            ack = _recv_exact(conn, 1)
        except StreamError as exc:
            raise StreamError(f"the holder did not acknowledge the replica's bytes: {exc}"
                              ) from exc
        if ack != ACK:
            raise StreamError(f"the holder did not acknowledge the replica's bytes: {ack!r}")
        if timings is not None:
            timings.update(connect_s=t1 - t0, stream_s=time.monotonic() - t1)
        ok = bool(verdict())
        conn.sendall(b"\x01" if ok else b"\x00")
        return ok
    except OSError as exc:
        raise StreamError(f"replica stream broke after connecting: {exc}") from exc
    finally:
        conn.close()


def receive(addr: tuple[str, int], token: bytes, dst: memoryview,
            timeout_s: float = 60.0) -> bool:
    """Connect to the source at ``addr`` (within :data:`CONNECT_TIMEOUT_S`), send
    ``token``, receive ``len(dst)`` bytes into ``dst`` (in place, no other copy; each
    ``recv`` waits ``timeout_s`` at most), acknowledge them (:data:`ACK`) and receive
    the verdict byte. Returns the verdict
    (``False``: the source's slot changed while it was sent; ``dst`` is torn).

    Raises:
        StreamError: the connection failed or ended early.
    """
    conn = None
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(*addr, type=socket.SOCK_STREAM)[0]
        conn = socket.socket(family, kind, proto)
        # before connect: the window scale is agreed in the handshake (tcp(7))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        conn.settimeout(min(CONNECT_TIMEOUT_S, timeout_s))
        conn.connect(sockaddr)
    except OSError as exc:
        if conn is not None:
            conn.close()
        raise StreamError(f"could not connect to the replica source {addr}: {exc}") from exc
    try:
        conn.settimeout(timeout_s)
        conn.sendall(token)
        n, off = len(dst), 0
        while off < n:
            got = conn.recv_into(dst[off:off + RECV_CHUNK])
            if not got:
                raise StreamError(f"replica stream from {addr} ended after {off} of {n} bytes")
            off += got
        conn.sendall(ACK)
        return _recv_exact(conn, 1) == b"\x01"
    except OSError as exc:
        raise StreamError(f"replica stream from {addr} broke: {exc}") from exc
    finally:
        conn.close()


def send_over_tcp(holder: Any, info: dict, seg: Any, h: Any,
                  timings: dict | None = None) -> str | None:
    """Send the data of the slot ``seg`` (a :class:`.shm.Segment`, header ``h``) to the
    ``holder`` persister actor (its ``pull_replica``) over one TCP connection, from
    ``seg``'s mapping (the caller's, kept between replicas: its page tables stay
    filled). Returns the holder's buffer name, or ``None`` when a save overwrote the
    slot while it was sent. ``timings``: as in :func:`send`.

    Raises:
        StreamError: no connection, or it broke (the caller falls back to Ray)."""
    import ray

    from dlrover_plugin_flashckpt.shm import holds_step

    try:   # released below (a view keeps the mapping from closing)
        data = seg.data_view(h)
    except ValueError:  # the caller's mapping was closed: the slot's file was replaced
        return None
    srv = listen(ray.util.get_node_ip_address())
    token = new_token()
    try:
        fut = holder.pull_replica.remote(info, srv.getsockname()[:2], token)

        def unchanged() -> bool:
            again = seg.read_header()
            return again.seq == h.seq and holds_step(again)

        send(srv, token, data, unchanged,
             gave_up=lambda: bool(ray.wait([fut], timeout=0)[0]), timings=timings)
        try:
            return ray.get(fut, timeout=600)
        except Exception as exc:  # noqa: BLE001 - the holder's side failed: fall back
            raise StreamError(f"the holder failed: {type(exc).__name__}: {exc}") from exc
    finally:
        data.release()
        srv.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, off = memoryview(buf), 0
    while off < n:
        got = conn.recv_into(view[off:])
        if not got:
            raise StreamError(f"connection closed after {off} of {n} bytes")
        off += got
    return bytes(buf)
