"""Agreement between the ranks of a role that have no torch.distributed group.

A load gathers what every rank holds (steps in memory, errors) to choose one step for
all ranks (:mod:`.loading`). With a process group that is ``all_gather_object``;
without one, every rank would choose from its own view, and two ranks could restore
different steps. :class:`GatherBoard` is a small Ray actor, named after the job and the
checkpoint directory, that plays ``all_gather_object``: each rank posts its value for
round ``k`` (the k-th gather of its saver) and gets the values of every rank once all
``world_size`` have posted.

Posts older than ``STALE_S`` are dropped, and a post into a round that is already
complete starts it again, so a round left over by ranks that died mid-load never mixes
with a new run's. A rank that waits more than ``timeout`` s gets ``None`` back and the
caller decides alone (logged), as without the board.
"""

from __future__ import annotations

import threading
import time
from typing import Any

#: seconds after which a post is no longer part of a round
STALE_S = 120.0


class GatherBoard:
    """Ray actor (threaded; create through :func:`board_for`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        #: round -> {rank: (posted at, value)}
        self._posts: dict[int, dict[int, tuple[float, Any]]] = {}
        self._reads: dict[int, int] = {}

    def gather(self, round_: int, rank: int, value: Any, world_size: int,
               timeout: float) -> list[Any] | None:
        """Post ``value`` of ``rank`` for ``round_``; return the ``world_size`` values in
        rank order once every rank has posted, or ``None`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            now = time.monotonic()
            posts = self._posts.setdefault(round_, {})
            for r in [r for r, (t, _) in posts.items() if now - t > STALE_S]:
                del posts[r]
            if len(posts) >= world_size:  # a complete round not read by all: a new run
                posts.clear()
                self._reads.pop(round_, None)
            posts[rank] = (now, value)
            self._cond.notify_all()
            while len(posts) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            out = [posts[r][1] if r in posts else None for r in range(world_size)]
            self._reads[round_] = self._reads.get(round_, 0) + 1
            if self._reads[round_] >= world_size:
                del self._posts[round_], self._reads[round_]
            return out


def board_for(job: str, directory: str) -> Any:
    """The gather board of ``job``'s checkpoint ``directory`` (created when missing).
    It lives as long as the process that created it (a rank); a rank that finds it
    gone gets an error and decides alone."""
    import ray

    from dlrover_plugin_flashckpt import shm
    from dlrover_plugin_flashckpt.handles import NAMESPACE

    return ray.remote(GatherBoard).options(
        name=f"dlrover-flash-gather-{shm.safe_name(job)}-{shm.dir_key(directory)}",
        namespace=NAMESPACE, get_if_exists=True, num_cpus=0, max_concurrency=256,
    ).remote()
