"""``JobContext``: the JobMaster's state, persisted in SQLite after every change.

Tables: ``kv`` (job-level values as JSON: state, spec, placement, restart counts,
checkpoint steps, bad nodes, timings) and ``instances`` (one row per role rank:
actor name, node, pid, state, attempt, last step). A restarted master reads it
back and re-attaches to the actors that are still alive. SQLite commits are atomic
and durable (journal + fsync), so a crash mid-write leaves the previous state.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class InstanceRecord:
    role: str
    rank: int
    actor_name: str = ""
    node_id: str = ""
    pid: int = 0
    state: str = "pending"  # pending, starting, running, succeeded, failed, restarting
    attempt: int = 0
    last_step: int = -1


class JobContext:
    """SQLite-backed state of one job. Thread-safe."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.RLock()
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

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put_instance(self, rec: InstanceRecord) -> None:
        d = asdict(rec)
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO instances VALUES (:role, :rank, :actor_name, :node_id,"
                " :pid, :state, :attempt, :last_step)", d)

    def update_instance(self, role: str, rank: int, **fields: Any) -> None:
        if not fields:
            return
        cols = ", ".join(f"{k} = :{k}" for k in fields)
        with self._lock:
            self._db.execute(f"UPDATE instances SET {cols} WHERE role = :role AND rank = :rank",
                             {**fields, "role": role, "rank": rank})

    def instances(self) -> list[InstanceRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT role, rank, actor_name, node_id, pid, state, attempt, last_step"
                " FROM instances ORDER BY role, rank").fetchall()
        return [InstanceRecord(*r) for r in rows]

    def clear(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM kv")
            self._db.execute("DELETE FROM instances")

    def close(self) -> None:
        with self._lock:
            self._db.close()
