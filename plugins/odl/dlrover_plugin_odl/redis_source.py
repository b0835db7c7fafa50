"""The ``redis`` stream source: Redis Streams with a consumer group.

Each ``source`` instance is one consumer (``<consumer_prefix><partition>``) of the
group ``group`` on the stream ``stream``. New entries come from ``XREADGROUP ... >``
(Redis hands each entry to one consumer and keeps it in that consumer's pending
entries list, PEL). The source *hands out* entries (returns them from
:meth:`RedisStreamSource.read`) in id order, without gaps:

- after a connection error or a timeout, the server may have delivered entries
  (put them in this consumer's PEL) whose reply never arrived; so the next read
  re-reads this consumer's PEL after the last entry handed out
  (``XREADGROUP ... <id>``, from ``0`` when none was) before it asks for new ones;
- after a restart, :meth:`RedisStreamSource.seek` does the same from the trainer's
  checkpointed position.

An entry is acknowledged (``XACK``) only when it was handed out *and* the driver
reports that a committed trainer checkpoint holds it (:meth:`RedisStreamSource.commit`
acks the PEL up to ``min(position, last handed out)``), so an entry delivered but
never handed to the trainer is never acknowledged. No entry is lost; only entries
trained after the trainer's last checkpoint are trained twice.

Entries hold the record as JSON in the field ``record`` (:func:`produce` writes
them that way); other entries become a dict of their decoded fields.

A broker that is down or unreachable is retried every 0.5 s: at the start for
``connect_timeout_s`` (a warning says what it waits for), while streaming for
``reconnect_timeout_s``; then :class:`BrokerUnavailable` names the address.
Consumer names are stable across restarts (the partition), so a restarted
source finds its own PEL.

A job resumed with fewer ``source`` instances (``n``) leaves entries pending at
consumers ``<consumer_prefix><k>``, ``k >= n``, that no longer exist (*departed*).
Partition ``k % n`` takes consumer ``k`` over (:meth:`RedisStreamSource.take_over`),
with the trainer's checkpointed offset of partition ``k`` that the driver passes to it:

- it finds the departed consumers from ``XINFO CONSUMERS`` (the names, nothing else)
  and reads each one's own PEL *as that consumer* (``XREADGROUP GROUP <group>
  <prefix><k> ... <id>``, never ``>``), in id order after the checkpointed offset,
  before its own entries. Entries never change owner: no ``XCLAIM`` or
  ``XAUTOCLAIM``, which takes idle entries of any consumer, live ones included, and
  would mix partition ``k``'s positions into this consumer's PEL, where this
  partition's offset could not tell them apart;
- the records it hands out from there carry ``ReadResult.partition = k``, so the
  trainer's checkpoint advances partition ``k``'s offset with them;
- entries at or before partition ``k``'s offset count as handed out (the checkpoint
  the job resumed from trained them): they are acknowledged with the next commit
  (:meth:`RedisStreamSource.commit_taken_over`, ``XACK`` of consumer ``k``'s PEL up to
  ``min(offset, last handed out)``), the rest once trained and committed, so the
  departed consumer's PEL empties and no entry is acknowledged untrained. A job
  resumed again (with any number of partitions) finds what is left where it was.

Partition 0 counts the entries pending at departed consumers when it starts
(``departed_pending``).

redis-py is an optional dependency: ``pip install 'dlrover-plugin-odl[redis]'``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

from dlrover_core.spec.errors import SpecError
from dlrover_plugin_odl.source import ReadResult, StreamSourceBase

log = logging.getLogger(__name__)

_OPTIONS = {
    "host": "127.0.0.1", "port": 6379, "db": 0, "stream": None, "group": "dlrover",
    "consumer_prefix": "", "connect_timeout_s": 60.0, "reconnect_timeout_s": 60.0,
    "socket_timeout_s": 5.0,
}


class BrokerUnavailable(ConnectionError):
    """The Redis broker could not be reached within ``connect_timeout_s`` (at the
    start) or ``reconnect_timeout_s`` (while streaming)."""


def validate_redis_options(options: dict) -> None:
    """Options: ``stream`` (required), ``host`` (127.0.0.1), ``port`` (6379), ``db``
    (0), ``group`` (``dlrover``), ``consumer_prefix`` (default ``<job>-``),
    ``connect_timeout_s`` (60: how long a starting source waits for the broker),
    ``reconnect_timeout_s`` (60: how long a running one waits after losing it),
    ``socket_timeout_s`` (5). Raises ``SpecError``."""
    for k, v in options.items():
        if k not in _OPTIONS:
            raise SpecError(f"config.odl.source.options.{k}", v,
                            "options of the redis source: " + ", ".join(sorted(_OPTIONS)))
    stream = options.get("stream")
    if not isinstance(stream, str) or not stream:
        raise SpecError("config.odl.source.options.stream", stream, "the name of a Redis stream")
    port = options.get("port", 6379)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise SpecError("config.odl.source.options.port", port, "a TCP port 1-65535")
    for k in ("connect_timeout_s", "reconnect_timeout_s", "socket_timeout_s"):
        v = options.get(k, _OPTIONS[k])
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise SpecError(f"config.odl.source.options.{k}", v, "seconds > 0")
    for k in ("host", "group"):
        v = options.get(k, _OPTIONS[k])
        if not isinstance(v, str) or not v:
            raise SpecError(f"config.odl.source.options.{k}", v, "a non-empty string")


def _import_redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ImportError("the redis stream source needs redis-py: "
                          "pip install 'dlrover-plugin-odl[redis]'") from None
    return redis


def produce(client: Any, stream: str, records: Iterable[dict]) -> list[str]:
    """Append ``records`` to ``stream`` (``XADD``, field ``record`` = JSON); returns the
    entry ids. ``client`` is a ``redis.Redis``."""
    pipe = client.pipeline(transaction=False)
    for rec in records:
        pipe.xadd(stream, {"record": json.dumps(rec)})
    return [i.decode() if isinstance(i, bytes) else i for i in pipe.execute()]


def id_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id ``"<ms>-<seq>"`` as a sortable tuple."""
    ms, _, seq = str(entry_id).partition("-")
    return int(ms), int(seq or 0)


class RedisStreamSource(StreamSourceBase):
    """One consumer of a Redis Streams consumer group (see the module docstring)."""

    def __init__(self, options: dict, partition: int, num_partitions: int, job: str = "") -> None:
        super().__init__(options, partition, num_partitions, job)
        validate_redis_options(self.options)
        opts = {**_OPTIONS, **self.options}
        self.host, self.port = str(opts["host"]), int(opts["port"])
        self.stream, self.group = str(opts["stream"]), str(opts["group"])
        prefix = opts["consumer_prefix"] or f"{job or 'dlrover'}-"
        self.consumer = f"{prefix}{partition}"
        self.connect_timeout_s = float(opts["connect_timeout_s"])
        self.reconnect_timeout_s = float(opts["reconnect_timeout_s"])
        redis = _import_redis()
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._response_error = redis.exceptions.ResponseError
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retries inside redis-py: _with_retry handles (and counts) outages
        self.client = redis.Redis(host=self.host, port=self.port, db=int(opts["db"]),
                                  socket_timeout=float(opts["socket_timeout_s"]),
                                  socket_connect_timeout=float(opts["socket_timeout_s"]),
                                  retry=Retry(NoBackoff(), 0))
        self.read_records = 0
        self.acked = 0
        # the ids of an XACK sent and not answered (see _ack_upto)
        self._ack_in_flight: tuple[str, list] | None = None
        self.reconnects = 0
        self.outage_s = 0.0
        # the id of the last entry handed out (or the seek position): the PEL up to
        # it has been handed out, in id order
        self._handed: str | None = None
        # where the next read re-reads this consumer's PEL from; None: new entries
        self._pending_cursor: str | None = "0"
        self._with_retry(self._ensure_group, timeout_s=self.connect_timeout_s, starting=True)
        self.departed_pending = 0
        if partition == 0:
            self.departed_pending = self._with_retry(self._count_departed)
        # departed partition k -> {"consumer", "handed", "cursor"} (see take_over)
        self._departed: dict[int, dict[str, Any]] = {}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # ------------------------------------------------------------------ broker access
    def _with_retry(self, fn: Any, *args: Any, timeout_s: float | None = None,
                    starting: bool = False) -> Any:
        """Run ``fn``; while the broker is unreachable, retry every 0.5 s for
        ``timeout_s`` (default ``reconnect_timeout_s``), then raise
        :class:`BrokerUnavailable`. After a connection error or timeout the next read
        re-reads this consumer's PEL after the last entry handed out."""
        timeout_s = self.reconnect_timeout_s if timeout_s is None else timeout_s
        key = "connect_timeout_s" if starting else "reconnect_timeout_s"
        t0 = None
        while True:
            try:
                out = fn(*args)
                if t0 is not None:
                    self.outage_s += time.monotonic() - t0
                    log.warning("redis broker at %s is back after %.1f s", self.address,
                                time.monotonic() - t0)
                return out
            except self._errors as exc:
                # a reply may have been lost after the server delivered entries
                self._pending_cursor = self._handed or "0"
                now = time.monotonic()
                if t0 is None:
                    t0 = now
                    self.reconnects += int(not starting)
                    log.warning("%s redis broker at %s (stream %r, group %r): %s; retrying "
                                "every 0.5 s for up to %.0f s (config.odl.source.options.%s)",
                                "waiting for the" if starting else "lost the", self.address,
                                self.stream, self.group, exc, timeout_s, key)
                if now - t0 >= timeout_s:
                    raise BrokerUnavailable(
                        f"redis broker at {self.address} (stream {self.stream!r}, group "
                        f"{self.group!r}) is unreachable for {now - t0:.1f} s "
                        f"(config.odl.source.options.{key}={timeout_s:g}): {exc}; start it "
                        f"or fix config.odl.source.options.host/port") from None
                time.sleep(0.5)
            except self._response_error as exc:
                if "NOGROUP" not in str(exc):
                    raise
                log.warning("consumer group %r of stream %r is gone (broker restarted without "
                            "its data?); creating it again", self.group, self.stream)
                self._ensure_group()

    def _ensure_group(self) -> None:
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except self._response_error as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def _departed_consumers(self) -> dict[int, tuple[str, int]]:
        """This group's consumers ``<prefix><k>`` with ``k`` >= the number of
        partitions and a non-empty PEL: ``k -> (name, pending entries)``."""
        prefix = self.consumer[:-len(str(self.partition))]
        out = {}
        for c in self.client.xinfo_consumers(self.stream, self.group):
            name, pending = _text(c["name"]), int(c["pending"])
            k = name[len(prefix):]
            if name.startswith(prefix) and k.isdigit() and int(k) >= self.num_partitions \
                    and pending:
                out[int(k)] = (name, pending)
        return out

    def _count_departed(self) -> int:
        """Pending entries of departed consumers; logs which partition takes each over."""
        departed = self._departed_consumers()
        if departed:
            log.warning("consumers %s of group %r on stream %r hold %d pending entries; "
                        "this job has %d source partitions: partition k %% %d reads and "
                        "acknowledges consumer k's", sorted(n for n, _ in departed.values()),
                        self.group, self.stream, sum(p for _, p in departed.values()),
                        self.num_partitions, self.num_partitions)
        return sum(p for _, p in departed.values())

    # ------------------------------------------------------------------ the interface
    def seek(self, position: Any | None) -> None:
        """Re-deliver this consumer's pending entries after ``position`` (all of them
        when ``None``), then continue with new entries. Entries up to ``position``
        count as handed out (a committed checkpoint holds them)."""
        self._handed = str(position) if position is not None else None
        self._pending_cursor = self._handed or "0"

    def take_over(self, positions: dict[int, Any]) -> None:
        """Take over the departed consumers ``<prefix><k>`` with ``k % num_partitions
        == partition`` that have pending entries; ``positions``: the trainer's
        checkpointed offset of partition ``k`` (absent: none of its entries trained).
        Their PELs are read before this consumer's (see the module docstring)."""
        found = self._with_retry(self._departed_consumers)
        self._departed = {}
        for k, (name, pending) in sorted(found.items()):
            if k % self.num_partitions != self.partition:
                continue
            pos = positions.get(k)
            handed = str(pos) if pos is not None else None
            self._departed[k] = {"consumer": name, "handed": handed, "cursor": handed or "0"}
            log.warning("partition %d takes over consumer %r (%d pending entries) of a "
                        "departed partition; its checkpointed offset: %s", self.partition,
                        name, pending, handed)

    def _xread(self, start: str, count: int, block_ms: int | None,
               consumer: str | None = None) -> list:
        out = self.client.xreadgroup(self.group, consumer or self.consumer,
                                     {self.stream: start}, count=count, block=block_ms)
        return out[0][1] if out else []

    def _fetch(self, max_records: int, block_ms: int) -> tuple[int | None, list]:
        """``(departed partition or None, entries)``: the PEL of a departed consumer
        taken over after its cursor, then this consumer's PEL after the cursor while
        there is one, then new entries. Retried as a whole by :meth:`_with_retry`,
        which moves this consumer's cursor back (a departed PEL is only re-read)."""
        for k, d in self._departed.items():
            if d["cursor"] is not None:
                entries = self._xread(d["cursor"], max_records, None, d["consumer"])
                if entries:
                    return k, entries
                d["cursor"] = None  # its PEL is handed out
        if self._pending_cursor is not None:
            entries = self._xread(self._pending_cursor, max_records, None)
            if entries:
                return None, entries
            self._pending_cursor = None  # the PEL is handed out; now new entries
        return None, self._xread(">", max_records, block_ms)

    def read(self, max_records: int, timeout_s: float) -> ReadResult:
        """Up to ``max_records`` entries of one consumer: first the pending ones of
        departed consumers taken over (``ReadResult.partition`` = theirs), then this
        consumer's pending ones after the last handed out (after a seek, a connection
        error or a timeout), then new ones (``XREADGROUP ... >``, blocking up to
        ``timeout_s``)."""
        positions: list[str] = []
        records: list[dict] = []
        k, entries = self._with_retry(self._fetch, max_records,
                                      max(1, int(timeout_s * 1000)))
        if entries:
            last = _text(entries[-1][0])
            if k is not None:
                self._departed[k]["handed"] = self._departed[k]["cursor"] = last
            else:
                self._handed = last
                if self._pending_cursor is not None:
                    self._pending_cursor = last
        for entry_id, fields in entries:
            if fields is None:  # deleted from the stream while pending
                continue
            eid = _text(entry_id)
            positions.append(eid)
            records.append(_decode(eid, fields))
        self.read_records += len(records)
        return ReadResult(positions, records, False, k)

    def _ack_upto(self, position: str, consumer: str | None = None) -> int:
        """``XACK`` the PEL of ``consumer`` up to ``position``; returns how many entries
        this call acknowledged, including those of an earlier try whose ``XACK`` reached
        the broker but whose reply was lost (connection error or timeout): they are no
        longer pending, so the retry would not see them."""
        consumer = consumer or self.consumer
        n = 0
        if self._ack_in_flight is not None:
            owner, sent = self._ack_in_flight
            still = self.client.xpending_range(self.stream, self.group, min=sent[0],
                                               max=sent[-1], count=len(sent),
                                               consumername=owner)
            n += len(set(sent) - {p["message_id"] for p in still})
            self._ack_in_flight = None
        while True:
            pending = self.client.xpending_range(self.stream, self.group, min="-", max=position,
                                                 count=1000, consumername=consumer)
            ids = [p["message_id"] for p in pending]
            if ids:
                self._ack_in_flight = (consumer, ids)
                n += self.client.xack(self.stream, self.group, *ids)
                self._ack_in_flight = None
            if len(ids) < 1000:
                return n

    def commit(self, position: Any) -> None:
        """``XACK`` this consumer's pending entries up to ``position`` that were handed
        out (up to the last one handed out, if that is before ``position``)."""
        if self._handed is None:
            return
        upto = min(str(position), self._handed, key=id_key)
        self.acked += self._with_retry(self._ack_upto, upto)

    def commit_taken_over(self, partition: int, position: Any) -> None:
        """``XACK`` the pending entries of the departed consumer of ``partition``
        (taken over by this source) up to ``min(position, last handed out)``; entries
        at or before its checkpointed offset count as handed out. Nothing for a
        partition not taken over."""
        d = self._departed.get(int(partition))
        if d is None or d["handed"] is None:
            return
        upto = min(str(position), d["handed"], key=id_key)
        self.acked += self._with_retry(self._ack_upto, upto, d["consumer"])

    def stats(self) -> dict[str, float]:
        return {"source_read_records": float(self.read_records),
                "source_acked": float(self.acked),
                "broker_reconnects": float(self.reconnects),
                "broker_outage_s": float(self.outage_s),
                "departed_pending": float(self.departed_pending)}

    def close(self) -> None:
        try:
            self.client.close()
        except Exception as exc:  # noqa: BLE001 - closing a dead connection
            log.debug("closing the redis client of %s: %s", self.address, exc)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _decode(entry_id: str, fields: dict) -> dict:
    f = {_text(k): _text(v) for k, v in fields.items()}
    rec = json.loads(f["record"]) if "record" in f else f
    if isinstance(rec, dict) and "id" not in rec:
        rec["id"] = entry_id
    return rec
