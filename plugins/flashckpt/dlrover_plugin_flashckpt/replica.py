"""Replicas of a node's saves in a peer node's memory (``checkpoint.options.replicas``).

The in-memory redundancy of Gemini (Wang et al., "GEMINI: Fast Failure Recovery in
Distributed Training with In-Memory Checkpoints", SOSP '23): after a save, each
node's persister copies its ranks' newest saves into the memory of the next node of
the ring (the job's alive nodes sorted by id, every alive node when no other of the
job's is left: :func:`peer_of`), asynchronously, so a job that loses a whole
node restores the newest saved step from the peer's memory instead of the newest
persisted one from disk.

On the holder, a replica is a buffer of the same format as a slot (:mod:`.shm`),
named ``dlrflash-<job>-<dir digest>-r<rank>-p<k>-n<holder node>``, two per source
rank (one is written while the other keeps the previous step), READY with the step,
the meta block and its crc32. Imports no torch.

Transfer: the source persister sends its slot's data area from its mapping of the slot
(``sendall``) over a TCP connection to the holder's persister that it keeps between
replicas, which receives it straight into its buffer (:mod:`.replica_stream`); when the
slot's sequence number moved before the holder acknowledged the last byte (a save
overwrote it) the replica is dropped, never marked READY. A connection that broke is
opened again for the next replica; when the TCP path fails (no connection: a firewall
between the nodes), the source puts the data area into the Ray object store instead
and the holder copies it out after Ray's object transfer (``transport`` in
:meth:`ReplicaSender.status`'s history says which).
A trainer reads a replica by path on its own node, else through the holder's
persister (:meth:`ReplicaHolder.read`, a Ray object; :mod:`.replica_loading`).

Parts, both in the persister actor's process: :class:`ReplicaSender` owns the
``flash-replicate`` thread, its connections to holders and the record of what it
replicated (it reads this node's slots through the :class:`.node_ranks.NodeRanks`,
never writes them); :class:`ReplicaHolder` owns the replica buffers it writes
(:func:`store`, in the actor's call threads and one thread per connection) and checks
every path a caller names.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from typing import Any, Callable

from dlrover_plugin_flashckpt import shm
from dlrover_plugin_flashckpt.handles import alive_nodes, rank_nodes
from dlrover_plugin_flashckpt.loopthread import LoopThread
from dlrover_plugin_flashckpt.node_ranks import NodeRanks
from dlrover_plugin_flashckpt.persisting import POLL_S
from dlrover_plugin_flashckpt.replica_buffers import (  # noqa: F401 - re-exported
    REPLICA_SLOTS,
    buffer_tag_at,
    folder_buffers,
    held,
    open_step,
    parse_replica,
    read,
    replica_name,
    store,
)
from dlrover_plugin_flashckpt.replica_stream import HolderError, Link, StreamError, open_link

log = logging.getLogger("dlrover_plugin_flashckpt.persister")
#: s the ring's list of the job's nodes (:meth:`ReplicaSender._job_nodes`) is kept
JOB_NODES_TTL_S = 10.0


def peer_of(node_id: str, alive: list[str], job_nodes: list[str] = ()) -> str | None:
    """The node after ``node_id`` in the ring (sorted ids) of the job's alive nodes
    (``job_nodes``: with ranks of the job) when one is not ``node_id``, else of
    every ``alive`` node; ``None`` when there is no other. A rank reshards from the
    buffers of its own node only, so a lost rank's replica on the head, which runs no
    rank, left a shrink the disk (make test SLOW=1, 2026-12-02, most likely so)."""
    mine = set(job_nodes) & set(alive)
    ring = sorted((mine if mine - {node_id} else set(alive)) | {node_id})
    if len(ring) < 2:
        return None
    return ring[(ring.index(node_id) + 1) % len(ring)]


class ReplicaHolder:
    """The holder side (see the module docstring): hold, list and hand out replicas
    of other nodes' saves.

    Args:
        ranks: this node's registrations (they say which directories are allowed).
        job, session, node_id: this persister's.
    """

    def __init__(self, ranks: NodeRanks, job: str, session: str, node_id: str) -> None:
        self.ranks = ranks
        self.job, self.session, self.node_id = job, session, node_id
        #: the replica buffers this holder writes, mapped once, page tables filled
        #: (:func:`store`'s ``mapped``); ``_mapped_lock`` serializes the stores
        self._mapped: dict[str, shm.Segment] = {}
        self._mapped_lock = threading.Lock()
        #: connections other nodes' persisters send replicas on (:meth:`open_link`)
        self._links: set = set()
        self._links_lock = threading.Lock()

    def _allowed_replica(self, path: str) -> str:
        """``path`` when it names a replica buffer of this job in an allowed shared-
        memory directory.

        Raises:
            ValueError: any other path."""
        name = os.path.basename(path) if isinstance(path, str) else ""
        try:
            self.ranks.allowed_shm_dir(os.path.dirname(path))
        except (ValueError, TypeError):
            raise ValueError(f"flash persister of job {self.job!r}: replica path {path!r} "
                             "is not in an allowed shared-memory directory") from None
        if not name.startswith(shm.job_prefix(self.job)) or parse_replica(name) is None:
            raise ValueError(f"flash persister of job {self.job!r}: {path!r} is not a replica "
                             f"buffer of this job (names start {shm.job_prefix(self.job)!r})")
        return path

    def _replica_ident(self, info: dict) -> dict:
        """The identity of a replica buffer for ``info``.

        Raises:
            ValueError: ``info["dir"]`` or ``info["shm_dir"]`` is not this job's."""
        self.ranks.allowed_dir(info.get("dir"))
        self.ranks.allowed_shm_dir(info.get("shm_dir", "/dev/shm"))
        return {"job": self.job, "role": info.get("role", ""), "rank": info["rank"],
                "world_size": info["world_size"], "dir": info["dir"], "session": self.session,
                "run_id": info.get("run_id", ""), "replica_of": info.get("source", "")}

    def store(self, info: dict, data: Any) -> str:
        """Hold a replica of another node's save (called by that node's persister;
        ``data`` arrives through Ray's object transfer). Returns the buffer name.

        Raises:
            ValueError: ``info["dir"]`` or ``info["shm_dir"]`` is not this job's."""
        ident = self._replica_ident(info)
        with self._mapped_lock:
            return store(info.get("shm_dir", "/dev/shm"), self.job, self.node_id, info,
                         data, ident, mapped=self._mapped)  # type: ignore[return-value]

    def open_link(self, addr: tuple[str, int], token: bytes) -> bool:
        """Connect to another node's persister listening at ``addr`` with ``token``
        (:func:`.replica_stream.connect`) and receive its replicas on that connection
        in a thread of this holder (``flash-replica-link``), each straight into a
        replica buffer (:func:`store`), until the source closes it. Returns True once
        connected.

        Raises:
            replica_stream.StreamError: no connection, or the source refused the token."""
        from dlrover_plugin_flashckpt.replica_stream import connect

        conn = connect((str(addr[0]), int(addr[1])), bytes(token))
        t = threading.Thread(target=self._serve, args=(conn,), name="flash-replica-link",
                             daemon=True)
        with self._links_lock:
            self._links.add(conn)
        t.start()
        return True

    def _hold(self, info: dict, fill: Callable[[memoryview], bool]) -> str | None:
        ident = self._replica_ident(info)   # ValueError: not this job's: the source is told
        with self._mapped_lock:
            return store(info.get("shm_dir", "/dev/shm"), self.job, self.node_id, info,
                         None, ident, fill=fill, mapped=self._mapped)

    def _serve(self, conn: Any) -> None:
        from dlrover_plugin_flashckpt.replica_stream import serve_link

        try:
            source = conn.getpeername()
            n = serve_link(conn, self._hold)
            log.info("flash replica link from %s closed after %d replicas", source, n)
        except (StreamError, OSError) as exc:
            log.info("flash replica link ended: %s", exc)
        finally:
            with self._links_lock:
                self._links.discard(conn)
            conn.close()

    def close(self) -> None:
        """Close the connections to other nodes' persisters (their threads end)."""
        with self._links_lock:
            links = list(self._links)
        for conn in links:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def listed(self, directory: str, shm_dir: str = "/dev/shm") -> dict:
        """Replicas of ``directory`` held on this node: ``{"node_id", "held": [{"name",
        "path", "rank", "world_size", "step", "bytes"}]}``."""
        if not isinstance(directory, str) or not os.path.isabs(directory):
            raise ValueError(f"replicas: directory {directory!r} is not an absolute path")
        self.ranks.allowed_shm_dir(shm_dir)  # listed; ``directory`` is only compared
        return {"node_id": self.node_id,
                "held": held(shm_dir, self.job, directory, self.node_id)}

    def read(self, path: str, step: int) -> dict:
        """The bytes of a replica held here (for a trainer on another node):
        ``{"meta", "data" (numpy uint8), "step"}``.

        Raises:
            ValueError: it no longer holds ``step``, or ``path`` is not a replica
                buffer of this job."""
        return read(self._allowed_replica(path), step)



class ReplicaSender:
    """The sender side (see the module docstring): copy this node's newest saves to
    the peer node, one at a time, in the ``flash-replicate`` thread.

    Args:
        ranks: this node's registrations and buffers.
        node_id: this node.
        peer: the persister actor of another node (created there when missing).
        error: records an error.
    """

    def __init__(self, ranks: NodeRanks, node_id: str, peer: Callable[[str], Any],
                 error: Callable[[str], None]) -> None:
        self.ranks, self.node_id = ranks, node_id
        self._peer, self._error = peer, error
        self._lock = ranks.lock
        #: (role, rank) -> (step, seq) of the last save replicated to the peer
        self._replicated: dict[tuple[str, int], tuple[int, int]] = {}
        self._ray_only_peers: set[str] = set()   # peers the TCP replica path failed for
        self._job_nodes_at: tuple[float, list[str]] = (-JOB_NODES_TTL_S, [])
        #: peer node -> the connection kept to its persister (used by the replicate
        #: thread only)
        self._links: dict[str, Link] = {}
        #: finished replications: role, rank, step, peer, bytes, seconds (and, over TCP,
        #: ``connect_s``: the time to open a connection, 0 on one kept from an earlier
        #: replica; ``stream_s``: :meth:`.replica_stream.Link.send`)
        self.history: list[dict] = []
        self._recorded = threading.Condition(self._lock)   # notified at each entry
        #: the ``flash-replicate`` thread (woken by a registration asking for replicas)
        self.thread = LoopThread("flash-replicate", self._replicate_loop)

    def _job_nodes(self) -> list[str]:
        """:func:`.handles.rank_nodes` of this job, asked again after ``JOB_NODES_TTL_S``."""
        now = time.monotonic()
        if now - self._job_nodes_at[0] > JOB_NODES_TTL_S:
            try:
                nodes = rank_nodes(self.ranks.job)
            except Exception as exc:  # noqa: BLE001 - the ring of every node, until asked again
                log.warning("could not list the nodes of %s: %s", self.ranks.job, exc)
                nodes = []
            self._job_nodes_at = (now, nodes)
        return self._job_nodes_at[1]

    def status(self) -> dict:
        """``replicated`` (``"role-rank"`` -> (step, seq)) and ``history``."""
        with self._lock:
            return {"replicated": {f"{k[0]}-{k[1]}": v for k, v in self._replicated.items()},
                    "history": list(self.history)}

    def wait(self, role: str, step: int, ranks: int = 1, timeout_s: float = 60.0) -> list[dict]:
        """The :attr:`history` entries of the replicas of ``step`` of ``role`` once
        ``ranks`` of its ranks are replicated (one call that returns when the entry is
        recorded, instead of polling :meth:`status`), or those there are after
        ``timeout_s`` s."""
        def mine() -> list[dict]:
            return [h for h in self.history if h["role"] == role and h["step"] == step]

        with self._recorded:
            self._recorded.wait_for(lambda: len(mine()) >= ranks, timeout=timeout_s)
            return mine()

    def _replicate_loop(self) -> None:
        try:
            while not self.thread.stopping:
                self.thread.pause(POLL_S * 4)
                try:
                    while not self.thread.stopping and self._replicate_one():
                        pass
                except Exception as exc:  # noqa: BLE001 - the loop must survive anything
                    self._error(f"replication: {type(exc).__name__}: {exc}\n"
                                + traceback.format_exc(limit=5))
        finally:
            for link in self._links.values():
                link.close()   # the holders' threads see the end of the stream
            self._links.clear()

    def _send_over_tcp(self, peer: str, info: dict, seg: shm.Segment, h: shm.Header,
                       timings: dict) -> str | None:
        """One replica over the connection kept to ``peer``'s persister, opened first
        when there is none; a kept connection that broke (the holder's persister was
        replaced) is opened again once. Returns the holder's buffer name, or ``None``
        when the slot changed (or its mapping was closed) before it was all sent.

        Raises:
            replica_stream.HolderError: the holder could not hold the replica (its
                error; the connection is kept).
            replica_stream.StreamError: no connection could be had, or it broke."""
        import ray

        try:  # released below (a view keeps the mapping from closing)
            data = seg.data_view(h)
        except ValueError:  # the mapping was closed: the slot's file was replaced
            return None

        def unchanged() -> bool:
            again = seg.read_header()
            return again.seq == h.seq and shm.holds_step(again)

        try:
            link = self._links.get(peer)
            if link is not None:
                timings["connect_s"] = 0.0
                try:
                    return link.send(info, data, unchanged, timings)
                except StreamError:  # closed: the holder's persister ended or was replaced
                    del self._links[peer]
            t0 = time.monotonic()
            link = self._links[peer] = open_link(self._peer(peer),
                                                 ray.util.get_node_ip_address())
            timings["connect_s"] = time.monotonic() - t0
            try:
                return link.send(info, data, unchanged, timings)
            except StreamError:
                del self._links[peer]
                raise
        finally:
            data.release()

    def _replicate_one(self) -> bool:
        """Copy one rank's newest save not replicated yet to the peer node; True when
        there was one (replicated or dropped)."""
        import ray

        todo = None
        with self._lock:
            for (role, rank), r in sorted(self.ranks.regs.items()):
                if not r.replicas:
                    continue
                steps = self.ranks.rank_steps(r, pending_only=False)
                if not steps:
                    continue
                step = max(steps)
                seg, h = steps[step]
                if self._replicated.get((role, rank)) != (step, h.seq):
                    todo = (r, seg, h)
                    break
        if todo is None:
            return False
        r, seg, h = todo
        peer = peer_of(self.node_id, alive_nodes(), self._job_nodes())
        if peer is None:
            with self._lock:
                self._replicated[(r.role, r.rank)] = (h.step, h.seq)
            log.warning("flash replica of %s rank %d step %d: no other node", r.role, r.rank,
                        h.step)
            return True
        t0 = time.monotonic()
        import numpy as np

        meta = seg.meta_bytes(h)
        info = {"dir": r.dir, "role": r.role, "rank": r.rank, "world_size": r.world_size,
                "step": h.step, "meta": meta, "data_len": h.data_len, "saved_at": h.saved_at,
                "run_id": r.run_id, "shm_dir": r.shm_dir, "source": self.node_id}
        transport = ("tcp" if r.replica_transport == "tcp" and peer not in self._ray_only_peers
                     else "ray")
        timings: dict = {}
        if transport == "tcp":
            try:
                name = self._send_over_tcp(peer, info, seg, h, timings)
            except HolderError as exc:   # as the Ray path's store would raise it
                raise RuntimeError(f"replica of {r.role} rank {r.rank} step {h.step}: the "
                                   f"holder on node {peer[:12]} refused it: {exc}") from exc
            except StreamError as exc:
                log.warning("flash replica of %s rank %d step %d over TCP to node %s failed "
                            "(%s); through Ray's object store, for this peer from now on",
                            r.role, r.rank, h.step, peer[:12], exc)
                self._ray_only_peers.add(peer)
                transport = "ray"
        if transport == "ray":
            holder = self._peer(peer)
            ref = ray.put(np.frombuffer(seg.mm, dtype=np.uint8, count=h.data_len,
                                        offset=h.data_offset))
            again = seg.read_header()
            name = (ray.get(holder.store_replica.remote(info, ref), timeout=600)
                    if again.seq == h.seq and shm.holds_step(again) else None)
            del ref
        if name is None:
            log.info("flash replica of %s rank %d step %d dropped: overwritten while copied",
                     r.role, r.rank, h.step)
            return True  # the newer save is replicated next
        with self._lock:
            self._replicated[(r.role, r.rank)] = (h.step, h.seq)
            self.history.append({"role": r.role, "rank": r.rank, "step": h.step,
                                         "peer": peer, "name": name, "bytes": h.data_len,
                                         "transport": transport,
                                         "seconds": round(time.monotonic() - t0, 4),
                                         **{k: round(v, 4) for k, v in timings.items()},
                                         "done_at": time.time()})
            del self.history[:-50]
            self._recorded.notify_all()
        return True
