"""What a trainer's saver tells its node's persister (:class:`Registration`), and the
persister's claim on one slot (:class:`Claim`). Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlrover_plugin_flashckpt import shm
from dlrover_plugin_flashckpt.lineage import make_attempt, meta_attempt


@dataclass
class Registration:
    """What a trainer's saver tells its persister (sent with every notification).

    Attributes: role, rank, world_size, dir (the role's checkpoint directory), keep,
    slots (paths of the rank's buffers), persist_every_steps, throttle_mib_s, run_id,
    shm_dir.
    """

    role: str
    rank: int
    world_size: int
    dir: str
    keep: int
    slots: list[str]
    persist_every_steps: int = 1
    throttle_mib_s: float = 0.0
    run_id: str = ""
    shm_dir: str = "/dev/shm"
    replicas: int = 0
    replica_transport: str = "tcp"
    extra: dict = field(default_factory=dict)


@dataclass
class Claim:
    rank: int
    seg: shm.Segment
    seq: int


def save_attempt(meta: bytes, reg: Registration) -> dict:
    """The attempt that made a save (a trailer of its meta block); a save without one
    (an older saver) counts as ``reg``'s run id + world size only."""
    return meta_attempt(meta) or make_attempt(reg.run_id, reg.world_size)
