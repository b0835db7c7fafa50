"""The load side of replicas (``checkpoint.options.replicas``, :mod:`.replica`): find
the replicas of a rank's saves held by any node's persister and restore one."""

from __future__ import annotations

import logging

from dlrover_plugin_flashckpt import layout
from dlrover_plugin_flashckpt.handles import persisters_of
from dlrover_plugin_flashckpt.reader import ShardReader, TornRead
from dlrover_plugin_flashckpt.replica import open_step

log = logging.getLogger("dlrover_plugin_flashckpt.persister")


class ReplicaLoadingMixin:
    """The replica part of a load, for :class:`.saver.FlashSaver` (which provides the
    rank and :meth:`_restore_from`): list the replicas of this rank's saves held by any
    node's persister, and restore one (by path on this node, else through its holder)."""

    # provided by FlashSaver
    rank: int
    world_size: int
    job: str
    dir: str
    opts: Any

    def _replica_steps(self) -> dict[tuple[int, str], dict]:
        """``(step, attempt tag)`` -> replica of this rank's save held by some node's
        persister (``{"path", "node_id", "handle"}``), the first holder listed per pair."""
        import ray

        out: dict[tuple[int, str], dict] = {}
        try:
            handles = persisters_of(self.job)
            answers = ray.get([h.replicas.remote(self.dir, self.opts.shm_dir)
                               for h in handles.values()], timeout=60)
        except Exception as exc:  # noqa: BLE001 - no replica then
            log.warning("could not list the flash replicas: %s", exc)
            return out
        for handle, a in zip(handles.values(), answers):
            for r in a["held"]:
                if r["rank"] == self.rank and r["world_size"] == self.world_size:
                    out.setdefault((r["step"], r.get("tag", "")),
                                   {"path": r["path"], "node_id": a["node_id"], "handle": handle})
        return out

    def _load_replica(self, state_dict: dict, step: int, rep: dict) -> None:
        """Restore ``step`` from a replica in a peer's memory: by path when it is held
        on this node, else through the holder's persister (a Ray object)."""
        import ray

        where = f"flash replica of rank {self.rank} step {step} on node {rep['node_id'][:12]}"
        if rep["node_id"] == ray.get_runtime_context().get_node_id():
            seg, h, meta = open_step(rep["path"], step)
            try:
                with ShardReader(rep["path"], h.data_offset) as rd:
                    self._restore_from(state_dict, meta, step, where,
                                       lambda e, dst: rd.submit(dst, e.offset))
                    rd.drain()
                if seg.read_header().seq != h.seq:
                    raise TornRead(f"{where} was overwritten while it was read")
            finally:
                seg.close()
            return
        got = ray.get(rep["handle"].read_replica.remote(rep["path"], step), timeout=600)
        data = got["data"]
        import warnings

        with warnings.catch_warnings():  # a read-only buffer, only read from
            warnings.simplefilter("ignore", UserWarning)
            self._restore_from(state_dict, got["meta"], step, where,
                               lambda e, dst: dst.copy_(layout.tensor_view(data, 0, e)))
