"""Replica bytes over a TCP connection kept between replicas: from the source node's
slot straight into the holder's replica buffer (``checkpoint.options.replicas``,
:mod:`.replica`).

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

One connection (a :class:`Link`) per pair of source and holder persisters, opened at
the first replica and kept: a replica then costs no Ray call, no new socket and no
handshake (a new connection per replica cost a Ray call to the holder and its return,
a listening socket and a TCP handshake: ~5-9 ms of a 64 MiB replica on this VM).

Opening a link (the source listens, the holder connects, so only the source's port
needs to be reachable):

1. the source binds an ephemeral port on its node's IP and asks the holder's
   persister (a Ray call, :meth:`.replica.ReplicaHolder.open_link`) to connect to it,
   with a 16-byte random token;
2. the holder connects and sends the token; the source compares it (a connection with
   another token is closed, the source keeps waiting until its deadline) and answers
   :data:`ACK`; the holder then serves the connection in a thread of its own
   (:func:`serve_link`) until it ends.

One replica on a link:

1. the source sends a frame (4-byte big-endian length, then JSON) with the replica's
   ``info`` (``dir``, ``rank``, ``world_size``, ``step``, ``data_len``, ...; its
   ``meta`` block apart), the meta block's bytes, then the ``data_len`` bytes of its
   slot;
2. the holder receives them straight into its buffer (or, when it cannot hold them:
   a directory not this job's, no shared memory, into a scratch buffer, to keep the
   connection in step) and, once it holds the last byte, sends :data:`ACK`;
3. after the acknowledgement the source sends one verdict byte: ``1`` when the slot's
   sequence number did not move while it was sent, ``0`` when a save overwrote it
   meanwhile (the holder then leaves the buffer not READY: a torn replica is never
   listed or loaded). The verdict is taken after the acknowledgement, when every byte
   the holder keeps has been read from the slot;
4. the holder answers with a result frame: its buffer's name, or torn, or the error
   that kept it from holding the replica (the source raises :class:`HolderError`).

A connection that breaks (a persister died or finished) raises :class:`StreamError`
on either side; the source drops the link and opens a new one for the next replica.

Imports no torch; Ray only in :func:`open_link`.
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import struct
import time
from typing import Any, Callable

TOKEN_BYTES = 16
#: the holder's byte after it received the whole replica (and the source's after it
#: accepted the holder's token)
ACK = b"\x06"
#: bytes per ``recv_into`` at most
RECV_CHUNK = 16 << 20
#: socket buffer sizes asked for (the kernel may cap them)
SOCKET_BUFFER = 8 << 20
#: seconds the holder tries to connect before the source falls back to Ray
CONNECT_TIMEOUT_S = 10.0
#: result frames: the buffer's name, torn (no replica), the holder's error
NAMED, TORN, FAILED = b"N", b"T", b"E"
_LEN = struct.Struct(">I")


class StreamError(RuntimeError):
    """The replica stream failed (no connection, a short read, a bad token)."""


class HolderError(RuntimeError):
    """The holder received the replica's bytes but could not hold them (its message
    says why: a directory not this job's, too little shared memory, ...); the link
    stays usable (so this is no :class:`StreamError`)."""


def new_token() -> bytes:
    return os.urandom(TOKEN_BYTES)


def listen(host: str) -> socket.socket:
    """A listening TCP socket on ``host``, an ephemeral port."""
    srv = socket.create_server((host, 0), backlog=4)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    return srv


def accept(srv: socket.socket, token: bytes, timeout_s: float = 60.0,
           gave_up: Callable[[], bool] = lambda: False) -> socket.socket:
    """The source's side of opening a link: accept, on the listening ``srv``, the
    connection that sends ``token`` (closing any that sends another), answer
    :data:`ACK`, return the connection (blocking, ``timeout_s`` per send or receive).
    ``gave_up()`` is polled while waiting (the holder's call failed: stop waiting).

    Raises:
        StreamError: no connection with the token within ``timeout_s`` s."""
    deadline = time.monotonic() + timeout_s
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
            got = recv_exact(conn, TOKEN_BYTES)
            if hmac.compare_digest(got, token):
                conn.sendall(ACK)   # the connection has the listening socket's buffer size
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn
        except (OSError, StreamError):
            pass
        conn.close()


def connect(addr: tuple[str, int], token: bytes, timeout_s: float = 60.0) -> socket.socket:
    """The holder's side of opening a link: connect to the source at ``addr`` (within
    :data:`CONNECT_TIMEOUT_S`), send ``token``, wait for the source's :data:`ACK`.
    Returns the connection.

    Raises:
        StreamError: no connection, or the source did not accept the token."""
    conn = None
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(*addr, type=socket.SOCK_STREAM)[0]
        conn = socket.socket(family, kind, proto)
        # before connect: the window scale is agreed in the handshake (tcp(7))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        conn.settimeout(min(CONNECT_TIMEOUT_S, timeout_s))
        conn.connect(sockaddr)
        conn.settimeout(timeout_s)
        conn.sendall(token)
        if recv_exact(conn, 1) != ACK:
            raise StreamError(f"the replica source {addr} did not accept the token")
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn
    except (OSError, StreamError) as exc:
        if conn is not None:
            conn.close()
        if isinstance(exc, StreamError):
            raise
        raise StreamError(f"could not connect to the replica source {addr}: {exc}") from exc


class Link:
    """The source's end of one connection to a holder persister, kept between replicas
    (used by one thread at a time: the source's ``flash-replicate`` thread).

    Args:
        conn: the connection :func:`accept` returned.
    """

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        #: replicas sent on this link
        self.sent = 0

    def send(self, info: dict, data: memoryview, verdict: Callable[[], bool],
             timings: dict | None = None) -> str | None:
        """Send one replica (see the module docstring): ``info`` (its ``meta`` bytes
        included; ``data_len`` == ``len(data)``), ``data`` (a view of the slot's
        mapping: no user-space copy), then, after the holder acknowledged the last
        byte, the verdict of ``verdict()``. Returns the holder's buffer name, or
        ``None`` when the verdict was that the slot changed (the holder kept no
        replica). ``timings``, when given, gets ``stream_s``: from the first byte of
        the frame sent until the acknowledgement, in s.

        Raises:
            HolderError: the holder could not hold the replica (the link stays usable).
            StreamError: the connection broke or the holder did not acknowledge the
                bytes (the link is closed).
            Whatever ``verdict`` raises (the link is closed).
        """
        meta = bytes(info.get("meta", b""))
        header = {k: v for k, v in info.items() if k != "meta"}
        header["meta_len"] = len(meta)
        if int(header["data_len"]) != len(data):
            raise ValueError(f"replica of rank {info.get('rank')}: data_len "
                             f"{header['data_len']} but {len(data)} bytes to send")
        head = json.dumps(header).encode()
        conn = self.conn
        try:
            t1 = time.monotonic()
            conn.sendall(_LEN.pack(len(head)) + head + meta)
            conn.sendall(data)
            try:
                ack = recv_exact(conn, 1)
            except StreamError as exc:
                raise StreamError(f"the holder did not acknowledge the replica's bytes: {exc}"
                                  ) from exc
            if ack != ACK:
                raise StreamError(f"the holder did not acknowledge the replica's bytes: {ack!r}")
            if timings is not None:
                timings["stream_s"] = time.monotonic() - t1
            ok = bool(verdict())
            conn.sendall(b"\x01" if ok else b"\x00")
            kind = recv_exact(conn, 1)
            text = recv_exact(conn, _LEN.unpack(recv_exact(conn, _LEN.size))[0]).decode()
        except (OSError, StreamError) as exc:
            self.close()
            if isinstance(exc, StreamError):
                raise
            raise StreamError(f"replica stream broke: {exc}") from exc
        except BaseException:
            self.close()   # stopped mid-replica (``verdict`` raised): out of step
            raise
        self.sent += 1
        if kind == NAMED:
            return text
        if kind == TORN:
            return None
        if kind == FAILED:
            raise HolderError(text)
        self.close()
        raise StreamError(f"replica stream: the holder answered {kind!r}")

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def serve_link(conn: socket.socket,
               hold: Callable[[dict, Callable[[memoryview], bool]], str | None]) -> int:
    """The holder's side of a link (``conn`` from :func:`connect`; between replicas it
    waits without a timeout, within one its timeout applies to each send and receive),
    until the source closes it: for each replica, read
    its frame and call ``hold(info, fill)`` (``info`` with its ``meta`` bytes), which
    must call ``fill(dst)`` once with the buffer ``dst`` of ``data_len`` bytes to
    receive into: ``fill`` receives the bytes, acknowledges them, reads the verdict and
    returns it. ``hold`` returns the buffer's name or ``None`` (torn); what it raises
    goes back to the source (:class:`HolderError`) after the bytes were taken into a
    scratch buffer. Returns the count of replicas received.

    Raises:
        StreamError: the connection broke in the middle of a replica."""
    count = 0
    timeout_s = conn.gettimeout()
    while True:
        try:
            conn.settimeout(None)  # between replicas a link waits as long as the job saves
            first = conn.recv(_LEN.size)
            conn.settimeout(timeout_s)
        except OSError as exc:
            raise StreamError(f"replica link broke: {exc}") from exc
        if not first:
            return count  # the source closed the link between replicas
        size = _LEN.unpack(first + recv_exact(conn, _LEN.size - len(first)))[0]
        info = json.loads(recv_exact(conn, size))
        info["meta"] = recv_exact(conn, int(info.pop("meta_len")))
        n = int(info["data_len"])
        state: dict = {}

        def fill(dst: memoryview) -> bool:
            if len(dst) != n or "verdict" in state:
                raise ValueError(f"replica of rank {info.get('rank')}: a buffer of "
                                 f"{len(dst)} bytes for {n}, or filled twice")
            state["received"] = True
            receive_into(conn, dst)
            state["verdict"] = _ack_and_verdict(conn)
            return state["verdict"]

        try:
            name = hold(info, fill)
            kind, text = (NAMED, name) if name is not None else (TORN, "")
        except StreamError:
            raise  # the connection itself: nothing more can be said on it
        except Exception as exc:  # noqa: BLE001 - the source is told
            kind, text = FAILED, f"{type(exc).__name__}: {exc}"
        if "received" not in state:  # hold failed before it took the bytes: drop them
            scratch = memoryview(bytearray(min(n, RECV_CHUNK) or 1))
            left = n
            while left:
                got = _recv_into(conn, scratch[:min(left, len(scratch))])
                left -= got
        if "verdict" not in state:
            _ack_and_verdict(conn)
            if kind == NAMED:  # hold returned without taking the bytes: a bug
                kind, text = FAILED, "the holder kept no bytes"
        try:
            body = (text or "").encode()
            conn.sendall(kind + _LEN.pack(len(body)) + body)
        except OSError as exc:
            raise StreamError(f"replica link broke: {exc}") from exc
        count += 1


def receive_into(conn: socket.socket, dst: memoryview) -> None:
    """Receive ``len(dst)`` bytes into ``dst`` (in place, no other copy).

    Raises:
        StreamError: the connection broke or ended early."""
    n, off = len(dst), 0
    while off < n:
        off += _recv_into(conn, dst[off:off + RECV_CHUNK], f" after {off} of {n} bytes")


def _recv_into(conn: socket.socket, view: memoryview, where: str = "") -> int:
    try:
        got = conn.recv_into(view)
    except OSError as exc:
        raise StreamError(f"replica stream broke{where}: {exc}") from exc
    if not got:
        raise StreamError(f"replica stream ended{where}")
    return got


def _ack_and_verdict(conn: socket.socket) -> bool:
    try:
        conn.sendall(ACK)
    except OSError as exc:
        raise StreamError(f"replica stream broke: {exc}") from exc
    return recv_exact(conn, 1) == b"\x01"


def open_link(holder: Any, host: str, timeout_s: float = 60.0) -> Link:
    """Open a link to the ``holder`` persister actor (its ``replica_link``): listen on
    ``host`` (this node's IP), ask the holder to connect, accept it.

    Raises:
        StreamError: the holder could not connect (the caller falls back to Ray)."""
    import ray

    srv = listen(host)
    token = new_token()
    try:
        fut = holder.replica_link.remote(srv.getsockname()[:2], token)
        conn = accept(srv, token, timeout_s,
                      gave_up=lambda: bool(ray.wait([fut], timeout=0)[0]))
        try:
            ray.get(fut, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - the holder's side failed: fall back
            conn.close()
            raise StreamError(f"the holder failed: {type(exc).__name__}: {exc}") from exc
        return Link(conn)
    finally:
        srv.close()


def recv_exact(conn: socket.socket, n: int) -> bytes:
    """The next ``n`` bytes of ``conn`` (:func:`receive_into` a new buffer).

    Raises:
        StreamError: the connection broke or ended early."""
    buf = bytearray(n)
    receive_into(conn, memoryview(buf))
    return bytes(buf)
