"""The redis stream source against a real redis-server (Debian's binary), started and
stopped here on a free loopback port with its own data directory."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from dlrover_plugin_odl.redis_server import LocalRedisServer, free_port
from dlrover_plugin_odl.redis_source import (
    BrokerUnavailable,
    RedisStreamSource,
    produce,
)

pytest.importorskip("redis")


@pytest.fixture(scope="module")
def server():
    with LocalRedisServer() as s:
        yield s


def source(server, stream, partition=0, **opts):
    return RedisStreamSource({"stream": stream, "port": server.port, **opts}, partition, 2, "t")


def drain(src, n_max=1000):
    out = []
    while True:
        r = src.read(50, 0.05)
        if not r.records:
            return out
        out.extend(zip(r.positions, [rec["id"] for rec in r.records]))
        assert len(out) <= n_max


def test_consumer_group_splits_the_stream_and_acks_only_on_commit(server):
    client = server.client()
    produce(client, "s1", [{"id": i, "x": [i]} for i in range(40)])
    a, b = source(server, "s1", 0), source(server, "s1", 1)
    got_a, got_b = a.read(25, 0.1), b.read(25, 0.1)
    ids = [r["id"] for r in got_a.records] + [r["id"] for r in got_b.records]
    assert sorted(ids) == list(range(40)) and len(got_a.records) == 25  # each entry once
    # read but not committed: every entry is pending in the group
    assert client.xpending("s1", "dlrover")["pending"] == 40
    a.commit(got_a.positions[9])  # a checkpoint holds a's first 10 entries
    pend = client.xpending("s1", "dlrover")
    assert pend["pending"] == 30
    assert {c["name"]: c["pending"] for c in pend["consumers"]} == {b"t-0": 15, b"t-1": 15}
    assert a.stats()["source_acked"] == 10


def test_seek_redelivers_the_pending_entries_after_the_checkpointed_position(server):
    client = server.client()
    produce(client, "s2", [{"id": i} for i in range(30)])
    first = source(server, "s2")
    r = first.read(20, 0.1)
    first.commit(r.positions[4])      # checkpoint holds ids 0-4
    # the source process dies; a new one seeks to the trainer's checkpointed position 7
    again = source(server, "s2")
    again.seek(r.positions[7])
    ids = [i for _, i in drain(again)]
    assert ids == list(range(8, 30))  # 8-19 re-delivered from the pending list, then new ones
    # 5-7 were in a committed checkpoint but not acked: the next commit acks them
    again.commit(r.positions[7])
    assert client.xpending_range("s2", "dlrover", "-", "+", 100)[0]["message_id"].decode() == \
        r.positions[8]


def test_broker_unreachable_at_start_waits_connect_timeout_then_names_the_address(caplog):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(BrokerUnavailable, match=f"127.0.0.1:{port}.*stream 'nowhere'.*"
                       r"connect_timeout_s=1\.5"):
        RedisStreamSource({"stream": "nowhere", "port": port, "connect_timeout_s": 1.5,
                           "socket_timeout_s": 0.5}, 0, 1, "t")
    assert time.monotonic() - t0 >= 1.5   # it waited, and not for reconnect_timeout_s (60)
    assert f"waiting for the redis broker at 127.0.0.1:{port}" in caplog.text
    assert "up to 2 s (config.odl.source.options.connect_timeout_s)" in caplog.text


def _blocked_client_id(client, name="t-0"):
    """The id of the connection blocked in XREADGROUP (by consumer ``name``)."""
    for _ in range(200):
        for c in client.client_list():
            if c.get("cmd") == "xreadgroup" and "b" in c.get("flags", ""):
                return c["id"]
        time.sleep(0.02)
    raise AssertionError(f"no client of {name} blocked in XREADGROUP")


def test_connection_dropped_after_delivery_rereads_the_pel_and_loses_nothing(server):
    client = server.client()
    produce(client, "s4", [{"id": i} for i in range(20)])
    src = source(server, "s4")
    seen = [i for _, i in drain(src)]
    assert seen == list(range(20))
    got: list = []
    reader = threading.Thread(target=lambda: got.append(src.read(50, 5.0)))
    reader.start()                      # blocked in XREADGROUP ... > BLOCK 5000
    victim = _blocked_client_id(client)
    # one pipeline: MULTI/EXEC of ten XADDs serves the blocked reader (entries 20-29
    # go to its PEL, the reply waits in its output buffer), then CLIENT KILL closes
    # its connection before the event loop writes that reply
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("MULTI")
    for i in range(20, 30):
        pipe.execute_command("XADD", "s4", "*", "record", f'{{"id": {i}}}')
    pipe.execute_command("EXEC")
    pipe.execute_command("CLIENT", "KILL", "ID", victim)
    assert pipe.execute()[-1] == 1
    reader.join(30)
    assert not reader.is_alive()
    # the server had delivered them before the connection went
    assert client.xpending("s4", "dlrover")["pending"] == 30
    seen += [rec["id"] for rec in got[0].records]      # re-read from this consumer's PEL
    seen += [i for _, i in drain(src)]
    assert seen == list(range(30))     # lost == 0, duplicated == 0
    assert src.stats()["broker_reconnects"] == 1
    src.commit(got[0].positions[-1])
    assert client.xpending("s4", "dlrover")["pending"] == 0


def test_an_entry_delivered_but_not_handed_out_is_never_acked(server):
    client = server.client()
    ids = produce(client, "s5", [{"id": i} for i in range(40)])
    src = source(server, "s5")
    assert [rec["id"] for rec in src.read(20, 0.1).records] == list(range(20))
    # entries 20-39 delivered to the same consumer, their reply lost on the way
    client.xreadgroup("dlrover", "t-0", {"s5": ">"}, count=20)
    src.commit(ids[39])   # a position past what this source handed out
    pending = client.xpending_range("s5", "dlrover", "-", "+", 100)
    assert [p["message_id"].decode() for p in pending] == ids[20:]
    assert src.stats()["source_acked"] == 20


class _DropOneReply:
    """A TCP proxy in front of the broker that closes the client's connection instead
    of passing on the reply to the first ``XACK``: the broker has acknowledged the
    entries (and written its append-only file); the source never hears it."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.armed, self.dropped = True, 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.lsock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            pending = threading.Event()   # an XACK went up; its reply is to be dropped
            threading.Thread(target=self._up, args=(client, server, pending),
                             daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, pending),
                             daemon=True).start()

    def _up(self, client, server, pending) -> None:
        while data := _recv(client):
            if self.armed and b"XACK" in data:
                self.armed = False
                pending.set()
            server.sendall(data)

    def _down(self, server, client, pending) -> None:
        while data := _recv(server):
            if pending.is_set():      # the XACK's reply: drop it and the connection
                self.dropped += 1
                for s in (client, server):
                    s.close()
                return
            client.sendall(data)

    def close(self) -> None:
        self.lsock.close()


def _recv(sock) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def test_acks_whose_reply_was_lost_are_counted_once(server):
    client = server.client()
    ids = produce(client, "s8", [{"id": i} for i in range(30)])
    proxy = _DropOneReply(server.port)
    try:
        src = RedisStreamSource({"stream": "s8", "port": proxy.port, "socket_timeout_s": 2.0,
                                 "reconnect_timeout_s": 30}, 0, 1, "t")
        assert [rec["id"] for rec in src.read(30, 0.1).records] == list(range(30))
        src.commit(ids[19])   # the XACK of 0-19 is applied; its reply is lost
        assert proxy.dropped == 1 and src.stats()["broker_reconnects"] == 1
        assert client.xpending("s8", "dlrover")["pending"] == 10
        # the retry finds 0-19 no longer pending: they were acknowledged, once
        assert src.stats()["source_acked"] == 20
        src.commit(ids[29])
        assert src.stats()["source_acked"] == 30
        assert client.xpending("s8", "dlrover")["pending"] == 0
    finally:
        proxy.close()


def test_broker_sigkilled_and_restarted_on_its_append_only_file_loses_nothing(tmp_path):
    with LocalRedisServer(data_dir=str(tmp_path)) as srv:
        produce(srv.client(), "s6", [{"id": i} for i in range(100)])
        src = RedisStreamSource({"stream": "s6", "port": srv.port, "socket_timeout_s": 1.0,
                                 "reconnect_timeout_s": 60}, 0, 1, "t")
        first = src.read(30, 0.1)
        seen = [rec["id"] for rec in first.records]
        src.commit(first.positions[14])  # a checkpoint holds ids 0-14
        seen += [rec["id"] for rec in src.read(30, 0.1).records]
        srv.kill()                       # SIGKILL mid-stream: no flush
        restart = threading.Timer(5.0, srv.start)
        restart.start()
        seen += [rec["id"] for rec in src.read(30, 0.1).records]  # waits, then goes on
        restart.join()
        produce(srv.client(), "s6", [{"id": i} for i in range(100, 120)])
        seen += [i for _, i in drain(src)]
        assert seen == list(range(120))  # lost == 0, duplicated == 0
        assert src.stats()["broker_reconnects"] == 1 and src.stats()["broker_outage_s"] >= 4.5
        # the consumer group, its PEL and the acks survived the kill
        assert srv.client().xpending("s6", "dlrover")["pending"] == 120 - 15


def test_broker_down_and_back_loses_nothing(tmp_path):
    with LocalRedisServer(data_dir=str(tmp_path)) as srv:
        client = srv.client()
        produce(client, "s3", [{"id": i} for i in range(100)])
        src = RedisStreamSource({"stream": "s3", "port": srv.port, "socket_timeout_s": 1.0,
                                 "reconnect_timeout_s": 60}, 0, 1, "t")
        seen = [rec["id"] for rec in src.read(30, 0.1).records]
        srv.stop()  # the broker goes down while the source is streaming
        restart = threading.Timer(2.0, srv.start)
        restart.start()
        t0 = time.monotonic()
        seen += [rec["id"] for rec in src.read(30, 0.1).records]  # waits, then goes on
        restart.join()
        assert time.monotonic() - t0 >= 1.5
        produce(srv.client(), "s3", [{"id": i} for i in range(100, 120)])
        seen += [i for _, i in drain(src)]
        assert seen == list(range(120))  # the stream and the group survived (AOF)
        assert src.stats()["broker_reconnects"] == 1


def test_entries_of_a_departed_consumer_are_counted_and_named(server, caplog):
    client = server.client()
    produce(client, "s7", [{"id": i} for i in range(12)])
    source(server, "s7")                       # creates the group
    client.xreadgroup("dlrover", "t-3", {"s7": ">"}, count=5)   # a job with 4 sources
    client.xreadgroup("dlrover", "t-1", {"s7": ">"}, count=4)   # still a partition
    src = RedisStreamSource({"stream": "s7", "port": server.port}, 0, 2, "t")
    assert src.stats()["departed_pending"] == 5
    assert "consumers ['t-3'] of group 'dlrover' on stream 's7' hold 5 pending" in caplog.text
    assert "partition k % 2 reads and acknowledges consumer k's" in caplog.text


def _pel(client, stream, consumer):
    return [p["message_id"].decode() for p in
            client.xpending_range(stream, "dlrover", "-", "+", 1000, consumername=consumer)]


def test_resume_with_fewer_partitions_takes_over_the_departed_consumers_pel(server):
    client = server.client()
    ids = produce(client, "s8", [{"id": i} for i in range(40)])
    # a job with 2 source partitions: consumer t-0 gets ids 0-19, t-1 ids 20-34 handed
    # out and 35-39 delivered with the reply lost
    a0, a1 = (RedisStreamSource({"stream": "s8", "port": server.port}, p, 2, "t")
              for p in (0, 1))
    assert [r["id"] for r in a0.read(20, 0.1).records] == list(range(20))
    assert [r["id"] for r in a1.read(15, 0.1).records] == list(range(20, 35))
    client.xreadgroup("dlrover", "t-1", {"s8": ">"}, count=5)
    a0.commit(ids[9])
    # the job stops; its last committed checkpoint trained 0-14 and 20-29, the driver
    # never acknowledged 10-14 and 20-29 (it died first)
    offsets = {"0": ids[14], "1": ids[29]}
    ids += produce(client, "s8", [{"id": i} for i in range(40, 50)])
    # resumed with 1 partition: it takes over consumer t-1 with partition 1's offset
    b = RedisStreamSource({"stream": "s8", "port": server.port}, 0, 1, "t")
    assert b.stats()["departed_pending"] == 20
    b.seek(offsets["0"])
    b.take_over({1: offsets["1"]})
    b.commit_taken_over(1, ids[39])    # nothing of t-1 handed out yet: only up to 29
    assert _pel(client, "s8", "t-1") == ids[30:40]
    trained = list(range(15)) + list(range(20, 30))
    while True:
        r = b.read(4, 0.05)
        if not r.records:
            break
        rids = [rec["id"] for rec in r.records]
        trained += rids
        # departed entries first, under partition 1's offset; then t-0's, then new
        assert r.partition == (1 if 30 <= rids[0] < 40 else None)
        if r.partition is not None:
            offsets["1"] = r.positions[-1]
        else:
            offsets["0"] = r.positions[-1]
    assert trained[25:] == list(range(30, 40)) + list(range(15, 20)) + list(range(40, 50))
    assert sorted(trained) == list(range(50))     # lost == 0, duplicated == 0
    # the live consumer kept its own entries: none was claimed, t-1 still owns its
    assert _pel(client, "s8", "t-0") == ids[10:20] + ids[40:50]
    assert _pel(client, "s8", "t-1") == ids[30:40]
    b.commit_taken_over(1, offsets["1"])
    b.commit(offsets["0"])
    assert _pel(client, "s8", "t-1") == [] and _pel(client, "s8", "t-0") == []
    assert client.xpending("s8", "dlrover")["pending"] == 0


def test_a_departed_consumer_goes_to_partition_k_mod_n_and_live_ones_keep_theirs(server):
    client = server.client()
    ids = produce(client, "s9", [{"id": i} for i in range(9)])
    source(server, "s9")                       # creates the group
    for c in ("t-0", "t-1", "t-2"):            # a job with 3 sources, nothing trained
        client.xreadgroup("dlrover", c, {"s9": ">"}, count=3)
    before = client.xpending_range("s9", "dlrover", "-", "+", 100, consumername="t-1")
    p0, p1 = (RedisStreamSource({"stream": "s9", "port": server.port}, p, 2, "t")
              for p in (0, 1))
    for p in (p0, p1):
        p.seek(None)
        p.take_over({})                        # no offset of partition 2 in the checkpoint
    r0, r1 = drain(p0), drain(p1)
    assert [i for _, i in r0] == [6, 7, 8, 0, 1, 2] and [i for _, i in r1] == [3, 4, 5]
    after = client.xpending_range("s9", "dlrover", "-", "+", 100, consumername="t-1")
    assert [p["message_id"] for p in after] == [p["message_id"] for p in before]
    p0.commit_taken_over(2, ids[8])
    p1.commit_taken_over(2, ids[8])            # not p1's: nothing happens
    assert _pel(client, "s9", "t-2") == [] and _pel(client, "s9", "t-0") == ids[:3]
