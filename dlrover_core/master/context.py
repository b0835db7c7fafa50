"""``JobContext``: the JobMaster's state, persisted in SQLite after every change.

Tables: ``kv`` (job-level values as JSON: state, spec, placement, restart counts,
checkpoint steps, bad nodes, timings) and ``instances`` (one row per role rank and
one for the driver: actor name, node, pid, state, attempt, last step; the row is
``Instance.record()`` of ``master.instances``). A restarted master reads it
back and re-attaches to the actors that are still alive. SQLite commits are atomic
and durable (journal + fsync), so a crash mid-write leaves the previous state.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from typing import Any


#: Columns of the ``instances`` table, in order (see ``master.instances.Instance``).
INSTANCE_COLUMNS = ("role", "rank", "actor_name", "node_id", "pid", "state", "attempt",
                    "last_step")


class JobContext:
    """SQLite-backed state of one job. Thread-safe."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
        #: committed write transactions so far (``benchmarks/master_scale.py`` reads it)
        self.writes = 0
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT)")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS instances (role TEXT, rank INTEGER, actor_name TEXT,"
            " node_id TEXT, pid INTEGER, state TEXT, attempt INTEGER, last_step INTEGER,"
            " PRIMARY KEY (role, rank))")

    def set(self, key: str, value: Any) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)",
                             (key, json.dumps(value, default=str)))
            self.writes += 1

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put_instance(self, row: dict) -> None:
        """Insert or replace one ``instances`` row (keys: ``INSTANCE_COLUMNS``)."""
        self.put_instances([row])

    def put_instances(self, rows: list[dict]) -> None:
        """Insert or replace ``instances`` rows in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT OR REPLACE INTO instances VALUES (:role, :rank, :actor_name,"
                    " :node_id, :pid, :state, :attempt, :last_step)", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self.writes += 1

    def update_instance(self, role: str, rank: int, **fields: Any) -> None:
        """Change some columns of one row (unknown columns raise ``ValueError``)."""
        self.update_instances([(role, rank, fields)])

    def update_instances(self, changes: list[tuple[str, int, dict]]) -> None:
        """Change columns of several rows in one transaction:
        ``[(role, rank, {column: value}), ...]``."""
        changes = [c for c in changes if c[2]]
        if not changes:
            return
        for _, _, fields in changes:
            bad = set(fields) - set(INSTANCE_COLUMNS[2:])
            if bad:
                raise ValueError(f"unknown instance column(s) {sorted(bad)}; allowed: "
                                 f"{', '.join(INSTANCE_COLUMNS[2:])}")
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for role, rank, fields in changes:
                    cols = ", ".join(f"{k} = :{k}" for k in fields)
                    self._db.execute(
                        f"UPDATE instances SET {cols} WHERE role = :role AND rank = :rank",
                        {**fields, "role": role, "rank": rank})
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self.writes += 1

    def instances(self) -> list[dict]:
        """Every ``instances`` row as a dict, ordered by role and rank."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {', '.join(INSTANCE_COLUMNS)} FROM instances ORDER BY role, rank"
            ).fetchall()
        return [dict(zip(INSTANCE_COLUMNS, r)) for r in rows]

    def clear(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM kv")
            self._db.execute("DELETE FROM instances")

    def close(self) -> None:
        with self._lock:
            self._db.close()
