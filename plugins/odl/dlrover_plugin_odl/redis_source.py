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
source finds its own PEL. Entries pending at a consumer that no longer exists (a
job restarted with fewer ``source`` instances) are not claimed: the trainer's
offsets of that partition are not known to the others, so a claim could not tell
trained entries from untrained ones. Partition 0 counts them
(``departed_pending``) and logs a warning naming the consumers.

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

    def _count_departed(self) -> int:
        """Pending entries of this group's consumers ``<prefix><k>`` with ``k`` >=
        the number of partitions; logs a warning naming them."""
        prefix = self.consumer[:-len(str(self.partition))]
        departed = {}
        for c in self.client.xinfo_consumers(self.stream, self.group):
            name, pending = _text(c["name"]), int(c["pending"])
            k = name[len(prefix):]
            if name.startswith(prefix) and k.isdigit() and int(k) >= self.num_partitions \
                    and pending:
                departed[name] = pending
        if departed:
            log.warning("consumers %s of group %r on stream %r hold %d pending entries but "
                        "this job has %d source partitions: they are not read; restart with "
                        "roles.source.total >= %d to read them, or XCLAIM them",
                        sorted(departed), self.group, self.stream, sum(departed.values()),
                        self.num_partitions, 1 + max(int(n[len(prefix):]) for n in departed))
        return sum(departed.values())

    # ------------------------------------------------------------------ the interface
    def seek(self, position: Any | None) -> None:
        """Re-deliver this consumer's pending entries after ``position`` (all of them
        when ``None``), then continue with new entries. Entries up to ``position``
        count as handed out (a committed checkpoint holds them)."""
        self._handed = str(position) if position is not None else None
        self._pending_cursor = self._handed or "0"

    def _xread(self, start: str, count: int, block_ms: int | None) -> list:
        out = self.client.xreadgroup(self.group, self.consumer, {self.stream: start},
                                     count=count, block=block_ms)
        return out[0][1] if out else []

    def _fetch(self, max_records: int, block_ms: int) -> list:
        """This consumer's PEL after the cursor while there is one, else new entries.
        Retried as a whole by :meth:`_with_retry`, which moves the cursor back."""
        if self._pending_cursor is not None:
            entries = self._xread(self._pending_cursor, max_records, None)
            if entries:
                return entries
            self._pending_cursor = None  # the PEL is handed out; now new entries
        return self._xread(">", max_records, block_ms)

    def read(self, max_records: int, timeout_s: float) -> ReadResult:
        """Up to ``max_records`` entries: first this consumer's pending ones after the
        last handed out (after a seek, a connection error or a timeout), then new
        ones (``XREADGROUP ... >``, blocking up to ``timeout_s``)."""
        positions: list[str] = []
        records: list[dict] = []
        entries = self._with_retry(self._fetch, max_records, max(1, int(timeout_s * 1000)))
        if entries:
            last = _text(entries[-1][0])
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
        return ReadResult(positions, records, False)

    def _ack_upto(self, position: str) -> int:
        n = 0
        while True:
            pending = self.client.xpending_range(self.stream, self.group, min="-", max=position,
                                                 count=1000, consumername=self.consumer)
            ids = [p["message_id"] for p in pending]
            if ids:
                n += self.client.xack(self.stream, self.group, *ids)
            if len(ids) < 1000:
                return n

    def commit(self, position: Any) -> None:
        """``XACK`` this consumer's pending entries up to ``position`` that were handed
        out (up to the last one handed out, if that is before ``position``)."""
        if self._handed is None:
            return
        upto = min(str(position), self._handed, key=id_key)
        self.acked += self._with_retry(self._ack_upto, upto)

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
