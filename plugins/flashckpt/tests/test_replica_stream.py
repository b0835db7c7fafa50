"""The TCP path of replicas (:mod:`dlrover_plugin_flashckpt.replica_stream`), without
Ray: real sockets on the loopback interface and real shared-memory buffers."""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import tempfile
import threading

import pytest

from dlrover_plugin_flashckpt import replica, replica_stream, shm

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
            "data_len": n}


def ident() -> dict:
    return {"job": JOB, "role": "trainer", "rank": 0, "world_size": 1, "dir": DIR,
            "session": "s", "run_id": "", "replica_of": "source-node"}


def serve(data, verdict, token: bytes, timeout_s: float = 30.0, timings=None):
    """Start the source side in a thread (``data``: bytes or a buffer, e.g. a view of a
    mapping; ``verdict``: a bool or a callable); returns (address, thread, result box)."""
    srv = replica_stream.listen("127.0.0.1")
    box: dict = {}
    src = memoryview(data)
    judge = verdict if callable(verdict) else (lambda: verdict)

    def run() -> None:
        try:
            box["ok"] = replica_stream.send(srv, token, src, judge, timeout_s=timeout_s,
                                            timings=timings)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            box["error"] = exc
        finally:
            srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[:2], t, box


def pull(shm_dir: str, addr, token: bytes, n: int, step: int = 7):
    return replica.store(shm_dir, JOB, HOLDER, info(n, step), None, ident(),
                         fill=lambda dst: replica_stream.receive(addr, token, dst))


def test_a_replica_sent_over_tcp_lands_in_the_holders_buffer_and_is_listed(shm_dir):
    data = os.urandom((5 << 20) + 123)   # not a multiple of the receive chunk
    token = replica_stream.new_token()
    addr, t, box = serve(data, True, token)
    name = pull(shm_dir, addr, token, len(data))
    t.join(10)
    assert box == {"ok": True}
    assert name is not None and name.startswith(shm.job_prefix(JOB))
    [h] = replica.held(shm_dir, JOB, DIR, HOLDER)
    assert (h["step"], h["bytes"], h["rank"]) == (7, len(data), 0)
    got = replica.read(h["path"], 7)
    assert got["meta"] == b"meta-block" and got["data"].tobytes() == data


def test_a_slot_overwritten_while_sent_leaves_no_replica(shm_dir):
    data = os.urandom(1 << 20)
    # a complete replica of step 6 first: the torn step 7 must not replace it
    token = replica_stream.new_token()
    addr, t, _ = serve(data, True, token)
    assert pull(shm_dir, addr, token, len(data), step=6) is not None
    t.join(10)
    token = replica_stream.new_token()
    addr, t, box = serve(data, False, token)
    assert pull(shm_dir, addr, token, len(data), step=7) is None
    t.join(10)
    assert box == {"ok": False}
    assert [h["step"] for h in replica.held(shm_dir, JOB, DIR, HOLDER)] == [6]
    states = []
    for path in shm.list_segments(shm_dir, shm.job_prefix(JOB)):
        seg = shm.Segment.attach(path)
        states.append((seg.read_header().state, seg.read_header().step))
        seg.close()
    assert sorted(states) == [(shm.EMPTY, -1), (shm.READY, 6)]


def test_a_connection_with_another_token_gets_nothing(shm_dir):
    data = os.urandom(1 << 20)
    token = replica_stream.new_token()
    addr, t, box = serve(data, True, token)
    rogue = socket.create_connection(addr, timeout=10)
    rogue.sendall(b"x" * replica_stream.TOKEN_BYTES)
    assert rogue.recv(1 << 16) == b""        # closed without a byte of the data
    rogue.close()
    assert pull(shm_dir, addr, token, len(data)) is not None   # the holder still gets it
    t.join(10)
    assert box == {"ok": True}


def test_no_holder_is_a_stream_error_and_a_dead_source_is_one_too(shm_dir):
    _, t, box = serve(b"abc", True, replica_stream.new_token(), timeout_s=0.5)
    t.join(10)
    assert isinstance(box.get("error"), replica_stream.StreamError)
    with socket.create_server(("127.0.0.1", 0)) as s:
        addr = s.getsockname()[:2]
    with pytest.raises(replica_stream.StreamError, match="could not connect"):
        pull(shm_dir, addr, replica_stream.new_token(), 10)


def test_a_slots_mapping_is_sent_and_judged_after_the_holder_has_every_byte(shm_dir):
    """The source's path (``send_over_tcp``: a view of its mapping of the slot's file, at
    the data offset): the bytes land bit for bit, and ``verdict()`` runs only once the
    holder holds the last byte (it reads the holder's buffer); 32 MiB, more than the
    socket buffers hold, so a verdict taken when the source's last byte left would see
    a partial buffer."""
    n, offset = (32 << 20) + 5, 4096 + 17
    data = os.urandom(n)
    path = os.path.join(shm_dir, "slot-file")
    with open(path, "wb") as f:
        f.write(os.urandom(offset) + data + os.urandom(99))
    seen: dict = {}

    def verdict() -> bool:
        seen["holder_had"] = bytes(seen["dst"]) == data
        return True

    def fill(dst):
        seen["dst"] = dst
        return replica_stream.receive(addr, token, dst)

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        view = memoryview(mm)[offset:offset + n]
        token, timings = replica_stream.new_token(), {}
        addr, t, box = serve(view, verdict, token, timings=timings)
        name = replica.store(shm_dir, JOB, HOLDER, info(n), None, ident(), fill=fill)
        t.join(10)
        view.release()
    assert box == {"ok": True} and name is not None
    assert seen["holder_had"] is True
    [h] = replica.held(shm_dir, JOB, DIR, HOLDER)
    assert replica.read(h["path"], 7)["data"].tobytes() == data
    assert set(timings) == {"connect_s", "stream_s"}
    assert all(0 <= v < 30 for v in timings.values())


def test_a_holder_that_does_not_acknowledge_the_bytes_gets_no_verdict():
    """A holder that reads every byte and closes without the acknowledgement: the
    source raises, and never asked for the verdict (nothing was judged complete)."""
    data = os.urandom(1 << 20)
    token = replica_stream.new_token()
    asked: list = []
    addr, t, box = serve(data, lambda: asked.append(1) or True, token)
    with socket.create_connection(addr, timeout=10) as conn:
        conn.sendall(token)
        got = 0
        while got < len(data):
            chunk = conn.recv(1 << 20)
            assert chunk
            got += len(chunk)
    t.join(10)
    assert isinstance(box.get("error"), replica_stream.StreamError)
    assert "acknowledge" in str(box["error"]) and asked == []


def test_a_slot_whose_mapping_was_closed_meanwhile_is_not_sent(shm_dir):
    """The persister retired and closed its mapping of the slot (the file was replaced)
    between picking the save and sending it: nothing is sent and nobody is asked to
    pull (``None``: the newer save is replicated next), no error."""
    seg = shm.Segment.create(os.path.join(shm_dir, "closed-slot"), 4096, 1 << 16,
                             ident(), bytes(16), 0, 1)
    h = seg.read_header()
    seg.close()

    class NoHolder:   # any call to it fails the test
        def __getattr__(self, name):
            raise AssertionError(f"the holder was asked: {name}")

    assert replica_stream.send_over_tcp(NoHolder(), info(h.data_len), seg, h) is None
