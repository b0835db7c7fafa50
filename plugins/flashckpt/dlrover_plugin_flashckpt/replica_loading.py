"""The load side of replicas (``checkpoint.options.replicas``, :mod:`.replica`) for
:class:`.saver.FlashSaver` (:class:`ReplicaSource`, used by the
:class:`.loading.Loader`): find the replicas of a rank's saves held by any node's
persister and restore one. It owns nothing: a replica buffer on this node is mapped
for the length of one restore (read only); one on another node is read by its
holder's persister (a Ray call). Runs in the training thread."""

from __future__ import annotations

import logging
from typing import Any

from dlrover_core.checkpoint.manifest import CorruptCheckpointError
from dlrover_plugin_flashckpt import layout
from dlrover_plugin_flashckpt.handles import persisters_of
from dlrover_plugin_flashckpt.meta import unpack_meta
from dlrover_plugin_flashckpt.reader import ShardReader, TornRead
from dlrover_plugin_flashckpt.replica import open_step

log = logging.getLogger("dlrover_plugin_flashckpt.persister")


def restore_rank(state_dict: dict, meta: bytes, rank: int, step: int, where: str,
                 fill: Any) -> None:
    """Restore ``rank``'s save of ``step`` (its meta block ``meta``) into
    ``state_dict``, each tensor's bytes written by ``fill(entry, dst)``.

    Raises:
        CorruptCheckpointError: the meta block is of another rank or step.
        LayoutError: the saved state does not fit the live one.
    """
    m = unpack_meta(meta)
    if m.get("rank") != rank or m.get("step") != step:
        raise CorruptCheckpointError(f"{where}: holds rank {m.get('rank')} step "
                                     f"{m.get('step')}")
    layout.restore(state_dict, m["skeleton"], m["table"], None, where, fill=fill)


class ReplicaSource:
    """The replicas of one rank's saves (see the module docstring).

    Args:
        job, directory, shm_dir: whose replicas, and where this node keeps them.
        rank, world_size: this rank.
    """

    def __init__(self, job: str, directory: str, shm_dir: str, rank: int,
                 world_size: int) -> None:
        self.job, self.dir, self.shm_dir = job, directory, shm_dir
        self.rank, self.world_size = rank, world_size

    def steps(self) -> dict[tuple[int, str], dict]:
        """``(step, attempt tag)`` -> replica of this rank's save held by some node's
        persister (``{"path", "node_id", "handle"}``), the first holder listed per pair."""
        import ray

        out: dict[tuple[int, str], dict] = {}
        try:
            handles = persisters_of(self.job)
            answers = ray.get([h.replicas.remote(self.dir, self.shm_dir)
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

    def load(self, state_dict: dict, step: int, rep: dict) -> None:
        """Restore ``step`` from a replica in a peer's memory: by path when it is held
        on this node, else through the holder's persister (a Ray object)."""
        import ray

        where = f"flash replica of rank {self.rank} step {step} on node {rep['node_id'][:12]}"
        if rep["node_id"] == ray.get_runtime_context().get_node_id():
            seg, h, meta = open_step(rep["path"], step)
            try:
                with ShardReader(rep["path"], h.data_offset) as rd:
                    restore_rank(state_dict, meta, self.rank, step, where,
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
            restore_rank(state_dict, got["meta"], self.rank, step, where,
                               lambda e, dst: dst.copy_(layout.tensor_view(data, 0, e)))
