"""The redis stream source against a real redis-server (Debian's binary), started and
stopped here on a free loopback port with its own data directory."""

from __future__ import annotations

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


def test_broker_unreachable_raises_an_error_naming_the_address():
    port = free_port()
    with pytest.raises(BrokerUnavailable, match=f"127.0.0.1:{port}.*stream 'nowhere'"):
        RedisStreamSource({"stream": "nowhere", "port": port, "reconnect_timeout_s": 1.0,
                           "socket_timeout_s": 0.5}, 0, 1, "t")


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
