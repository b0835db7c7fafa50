"""The ``source`` role's workload (:class:`SourceWorkload`), re-exported by
:mod:`dlrover_plugin_odl.workloads` (where the roles are described)."""

from __future__ import annotations

from typing import Any

from dlrover_core import BaseWorkload
from dlrover_plugin_odl import ledger
from dlrover_plugin_odl.columns import to_columns
from dlrover_plugin_odl.config import ODLConfig


class SourceWorkload(BaseWorkload):
    """The ``source`` role: one partition of the stream source named by
    ``config.odl.source.kind`` (partition = rank)."""

    def setup(self) -> None:
        from dlrover_core.plugins.manager import get_plugin_manager
        from dlrover_core.plugins.records import resolve

        self.odl = ODLConfig.from_config(self.config)
        record = get_plugin_manager().stream_sources.get(self.odl.source.kind)
        cls = resolve(record.source)
        self.stream = cls(dict(self.odl.source.options), self.rank, self.world_size,
                          self.context.job)
        self._logs: dict[str, Any] = {}   # partition key -> its handed-out log

    def seek(self, position: Any | None, departed: dict | None = None) -> None:
        """Resume after ``position``; ``departed``: offsets (``str(k) -> position``)
        of departed partitions this one takes over (see
        :meth:`StreamSourceBase.take_over`)."""
        self.stream.seek(position)
        self.stream.take_over({int(k): v for k, v in (departed or {}).items()})

    def read(self, max_records: int) -> dict:
        """Read one chunk. Returns its metadata ``{"partition", "key", "n", "first",
        "last", "end"}`` (``key``: the partition whose offset ``last`` is, ``str``);
        the records stay in the object store, referenced by ``data``
        (a one-element list holding the ``ObjectRef``, so the driver never fetches
        them), as columns (:func:`dlrover_plugin_odl.columns.to_columns`): the object
        is ``{"partition", "key", "positions", "n", "columns"}``."""
        import ray

        r = self.stream.read(max_records, self.odl.read_timeout_s)
        # key: the partition whose offset the positions advance (a departed one
        # taken over, or this one)
        key = self.rank if r.partition is None else r.partition
        meta: dict[str, Any] = {"partition": self.rank, "key": str(key),
                                "n": len(r.records), "end": r.end,
                                "first": r.positions[0] if r.positions else None,
                                "last": r.positions[-1] if r.positions else None}
        if r.records:
            columns = to_columns(r.records)
            meta["data"] = [ray.put({"partition": self.rank, "key": str(key),
                                     "positions": r.positions, "n": len(r.records),
                                     "columns": columns})]
            if self.odl.log_record_ids and self.job_dir:
                if str(key) not in self._logs:
                    self._logs[str(key)] = ledger.open_log(self.job_dir, ledger.HANDED_OUT,
                                                           key)
                ledger.write_handed_out(self._logs[str(key)], r.positions,
                                        ledger.column_ids(columns.get("id"), key, r.positions))
        return meta

    def commit(self, position: Any, partition: int | None = None) -> None:
        """A committed checkpoint holds this partition's records up to ``position``
        (or, with ``partition``, those of that departed partition taken over)."""
        if partition is None or int(partition) == self.rank:
            self.stream.commit(position)
        else:
            self.stream.commit_taken_over(int(partition), position)

    def stats(self) -> dict[str, float]:
        return self.stream.stats()

    def teardown(self) -> None:
        stream = getattr(self, "stream", None)
        if stream is not None:
            stream.close()
        for log in getattr(self, "_logs", {}).values():
            log.close()
