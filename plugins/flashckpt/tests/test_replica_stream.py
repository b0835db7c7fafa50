"""The TCP path of replicas (:mod:`dlrover_plugin_flashckpt.replica_stream`), without
Ray: real sockets on the loopback interface, a connection kept between replicas, and
real shared-memory buffers."""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import tempfile
import threading
import time

import pytest

from dlrover_plugin_flashckpt import replica, replica_stream, shm
from dlrover_plugin_flashckpt.node_ranks import NodeRanks

JOB = "streamtest"
DIR = "/ckpt/streamtest/trainer"
HOLDER = "0123456789abcdef0123"


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="dlrstream", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def info(n: int, step: int = 7) -> dict:
    return {"dir": DIR, "rank": 0, "world_size": 1, "step": step, "meta": b"meta-block",
            "data_len": n, "saved_at": 123.5}


def ident() -> dict:
    return {"job": JOB, "role": "trainer", "rank": 0, "world_size": 1, "dir": DIR,
            "session": "s", "run_id": "", "replica_of": "source-node"}


class Holder:
    """The holder's end of a link in a thread: ``serve_link`` storing each replica into
    ``shm_dir`` (or, with ``hold``, what ``hold`` does); ``box`` gets its count or
    error when the link ends."""

    def __init__(self, conn: socket.socket, shm_dir: str, hold=None) -> None:
        self.box: dict = {}
        self.hold = hold or (lambda i, fill: replica.store(shm_dir, JOB, HOLDER, i, None,
                                                           ident(), fill=fill))
        self.thread = threading.Thread(target=self._run, args=(conn,), daemon=True)
        self.thread.start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.box["count"] = replica_stream.serve_link(conn, self.hold)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            self.box["error"] = exc
        finally:
            conn.close()


def link_pair(timeout_s: float = 30.0) -> tuple[replica_stream.Link, socket.socket]:
    """Open a link over loopback as the persisters do (the source listens and accepts
    the holder's token): (the source's Link, the holder's connection)."""
    srv = replica_stream.listen("127.0.0.1")
    token = replica_stream.new_token()
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(
        conn=replica_stream.accept(srv, token, timeout_s)), daemon=True)
    t.start()
    held = replica_stream.connect(srv.getsockname()[:2], token, timeout_s)
    t.join(10)
    srv.close()
    return replica_stream.Link(box["conn"]), held


def slots(shm_dir: str) -> list[tuple[int, int]]:
    out = []
    for path in shm.list_segments(shm_dir, shm.job_prefix(JOB)):
        seg = shm.Segment.attach(path)
        out.append((seg.read_header().state, seg.read_header().step))
        seg.close()
    return sorted(out)


def test_replicas_sent_on_one_kept_connection_land_in_the_holders_buffers(shm_dir):
    """Three replicas, one connection: each lands bit for bit with its meta block and
    step (a size not a multiple of the receive chunk, then a larger one: the buffer is
    grown), the holder keeps the two newest, and the holder's thread ends with the
    count when the source closes the link."""
    link, conn = link_pair()
    holder = Holder(conn, shm_dir)
    sent = {}
    for step, n in ((5, (5 << 20) + 123), (6, 1 << 20), (7, (9 << 20) + 1)):
        data = sent[step] = os.urandom(n)
        timings: dict = {}
        name = link.send(info(n, step), memoryview(data), lambda: True, timings)
        assert name is not None and name.startswith(shm.job_prefix(JOB))
        assert 0 <= timings["stream_s"] < 30
    assert link.sent == 3
    listed = {h["step"]: h for h in replica.held(shm_dir, JOB, DIR, HOLDER)}
    assert sorted(listed) == [6, 7]
    for step in (6, 7):
        got = replica.read(listed[step]["path"], step)
        assert got["meta"] == b"meta-block" and got["data"].tobytes() == sent[step]
    link.close()
    holder.thread.join(10)
    assert holder.box == {"count": 3}


def test_a_slot_overwritten_while_sent_leaves_no_replica_and_the_link_goes_on(shm_dir):
    link, conn = link_pair()
    Holder(conn, shm_dir)
    data = os.urandom(1 << 20)
    # a complete replica of step 6 first: the torn step 7 must not replace it
    assert link.send(info(len(data), 6), memoryview(data), lambda: True) is not None
    assert link.send(info(len(data), 7), memoryview(data), lambda: False) is None
    assert [h["step"] for h in replica.held(shm_dir, JOB, DIR, HOLDER)] == [6]
    assert slots(shm_dir) == [(shm.EMPTY, -1), (shm.READY, 6)]
    # the same connection carries the next save
    assert link.send(info(len(data), 8), memoryview(data), lambda: True) is not None
    assert sorted(h["step"] for h in replica.held(shm_dir, JOB, DIR, HOLDER)) == [6, 8]
    link.close()


def test_a_holder_that_cannot_hold_a_replica_says_why_and_the_link_goes_on(shm_dir):
    """The holder refuses before it took the bytes (a directory not the job's): it
    drops the bytes, the source raises HolderError with the holder's message, and the
    next replica on the same connection lands."""
    def hold(i, fill):
        if i["step"] == 3:
            raise ValueError(f"directory {i['dir']!r} is not this job's")
        return replica.store(shm_dir, JOB, HOLDER, i, None, ident(), fill=fill)

    link, conn = link_pair()
    Holder(conn, shm_dir, hold)
    data = os.urandom((3 << 20) + 7)
    with pytest.raises(replica_stream.HolderError, match="ValueError: directory"):
        link.send(info(len(data), 3), memoryview(data), lambda: True)
    assert replica.held(shm_dir, JOB, DIR, HOLDER) == []
    assert link.send(info(len(data), 4), memoryview(data), lambda: True) is not None
    [h] = replica.held(shm_dir, JOB, DIR, HOLDER)
    assert replica.read(h["path"], 4)["data"].tobytes() == data
    link.close()


def test_a_link_idle_longer_than_its_timeout_still_carries_the_next_replica(shm_dir):
    """Between saves the holder waits without a timeout (a job saves every few minutes
    or hours); within a replica each receive has one."""
    link, conn = link_pair(timeout_s=0.3)
    holder = Holder(conn, shm_dir)
    data = os.urandom(1 << 16)
    assert link.send(info(len(data), 1), memoryview(data), lambda: True) is not None
    time.sleep(1.0)
    assert "error" not in holder.box
    assert link.send(info(len(data), 2), memoryview(data), lambda: True) is not None
    link.close()


def test_a_connection_with_another_token_gets_nothing(shm_dir):
    srv = replica_stream.listen("127.0.0.1")
    token = replica_stream.new_token()
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(
        conn=replica_stream.accept(srv, token, 30)), daemon=True)
    t.start()
    rogue = socket.create_connection(srv.getsockname()[:2], timeout=10)
    rogue.sendall(b"x" * replica_stream.TOKEN_BYTES)
    assert rogue.recv(1 << 16) == b""        # closed without the acceptance byte
    rogue.close()
    conn = replica_stream.connect(srv.getsockname()[:2], token)   # the holder still gets in
    t.join(10)
    srv.close()
    Holder(conn, shm_dir)
    link = replica_stream.Link(box["conn"])
    assert link.send(info(10), memoryview(b"0123456789"), lambda: True) is not None
    link.close()


def test_no_holder_is_a_stream_error_and_a_dead_source_is_one_too():
    srv = replica_stream.listen("127.0.0.1")
    with pytest.raises(replica_stream.StreamError, match="no holder connected"):
        replica_stream.accept(srv, replica_stream.new_token(), timeout_s=0.5)
    with pytest.raises(replica_stream.StreamError, match="no holder connected"):
        replica_stream.accept(srv, replica_stream.new_token(), gave_up=lambda: True)
    srv.close()
    with socket.create_server(("127.0.0.1", 0)) as s:
        addr = s.getsockname()[:2]
    with pytest.raises(replica_stream.StreamError, match="could not connect"):
        replica_stream.connect(addr, replica_stream.new_token())


def test_a_slots_mapping_is_sent_and_judged_after_the_holder_has_every_byte(shm_dir):
    """The source's path: a view of its mapping of the slot's file, at the data offset:
    the bytes land bit for bit, and ``verdict()`` runs only once the holder holds the
    last byte (it reads the holder's buffer); 32 MiB, more than the socket buffers
    hold, so a verdict taken when the source's last byte left would see a partial
    buffer."""
    n, offset = (32 << 20) + 5, 4096 + 17
    data = os.urandom(n)
    path = os.path.join(shm_dir, "slot-file")
    with open(path, "wb") as f:
        f.write(os.urandom(offset) + data + os.urandom(99))
    seen: dict = {}

    def verdict() -> bool:
        seen["holder_had"] = bytes(seen["dst"]) == data
        return True

    def hold(i, fill):
        def watched(dst):
            seen["dst"] = dst
            return fill(dst)
        return replica.store(shm_dir, JOB, HOLDER, i, None, ident(), fill=watched)

    link, conn = link_pair()
    Holder(conn, shm_dir, hold)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)[offset:offset + n]
        name = link.send(info(n), view, verdict)
        view.release()
    assert name is not None
    assert seen["holder_had"] is True
    [h] = replica.held(shm_dir, JOB, DIR, HOLDER)
    assert replica.read(h["path"], 7)["data"].tobytes() == data
    link.close()


def test_a_holder_that_does_not_acknowledge_the_bytes_gets_no_verdict():
    """A holder that reads every byte and closes without the acknowledgement: the
    source raises, never asked for the verdict (nothing was judged complete), and the
    link is closed."""
    data = os.urandom(1 << 20)
    link, conn = link_pair()
    asked: list = []

    def read_all_and_close() -> None:   # the frame, the meta block, every data byte
        size = replica_stream._LEN.unpack(replica_stream.recv_exact(conn, 4))[0]
        head = replica_stream.json.loads(replica_stream.recv_exact(conn, size))
        replica_stream.recv_exact(conn, head["meta_len"] + head["data_len"])
        conn.close()

    t = threading.Thread(target=read_all_and_close, daemon=True)
    t.start()
    with pytest.raises(replica_stream.StreamError, match="acknowledge"):
        link.send(info(len(data)), memoryview(data), lambda: asked.append(1) or True)
    t.join(10)
    assert asked == []
    assert link.conn.fileno() == -1   # closed


def test_a_source_that_dies_in_the_middle_leaves_the_holders_buffer_not_ready(shm_dir):
    """The source's connection ends after half the bytes: the holder's thread ends with
    a StreamError and no replica is listed (the buffer stays WRITING: never loaded)."""
    link, conn = link_pair()
    holder = Holder(conn, shm_dir)
    n = 4 << 20
    head = replica_stream.json.dumps({k: v for k, v in info(n).items() if k != "meta"}
                                     | {"meta_len": 10}).encode()
    link.conn.sendall(replica_stream._LEN.pack(len(head)) + head + b"meta-block"
                      + os.urandom(n // 2))
    link.close()
    holder.thread.join(10)
    assert isinstance(holder.box.get("error"), replica_stream.StreamError), holder.box
    assert replica.held(shm_dir, JOB, DIR, HOLDER) == []
    assert [s for s, _ in slots(shm_dir)] == [shm.WRITING]


def test_a_slot_whose_mapping_was_closed_meanwhile_is_not_sent(shm_dir):
    """The persister retired and closed its mapping of the slot (the file was replaced)
    between picking the save and sending it: nothing is sent and no holder is asked
    for (``None``: the newer save is replicated next), no error."""
    seg = shm.Segment.create(os.path.join(shm_dir, "closed-slot"), 4096, 1 << 16,
                             ident(), bytes(16), 0, 1)
    h = seg.read_header()
    seg.close()

    def no_holder(node):   # any call fails the test
        raise AssertionError(f"the holder on {node} was asked for")

    sender = replica.ReplicaSender(NodeRanks(JOB, os.getpid(), 0), "node-a", no_holder,
                                   lambda e: None)
    assert sender._send_over_tcp("node-b", info(h.data_len), seg, h, {}) is None


def test_a_verdict_that_raises_closes_the_link_and_the_holder_keeps_no_replica(shm_dir):
    """``verdict()`` raising after the holder acknowledged the bytes leaves the
    connection out of step (the holder waits for a verdict byte): the source closes the
    link and raises; the holder's thread ends and lists no replica of that step."""
    link, conn = link_pair()
    holder = Holder(conn, shm_dir)
    data = os.urandom(1 << 16)

    def broken() -> bool:
        raise ValueError("the slot's header could not be read")

    with pytest.raises(ValueError, match="header could not be read"):
        link.send(info(len(data)), memoryview(data), broken)
    assert link.conn.fileno() == -1
    holder.thread.join(10)
    assert isinstance(holder.box.get("error"), replica_stream.StreamError), holder.box
    assert replica.held(shm_dir, JOB, DIR, HOLDER) == []
