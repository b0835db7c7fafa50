"""``checkpoint.options`` of the ``flash`` saver, validated."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.fields import check_fields, read_fields, refuse_unknown, spec_field

VERIFY_MODES = ("header", "data")
REPLICA_TRANSPORTS = ("tcp", "ray")


@dataclass(frozen=True)
class FlashOptions:
    """Settings of the flash saver (``checkpoint.options`` in the job spec).

    Attributes:
        persist_every_steps: a saved step is written to the checkpoint directory when
            ``step % persist_every_steps == 0``; the other saves live in shared memory
            only (they still reach the disk at a breakpoint or at the end of the job).
            Default 1: every save is persisted.
        slots: shared-memory buffers per rank (double buffering with 2). A save never
            overwrites a buffer that is being persisted; with no free buffer it skips
            (logged), it never waits.
        shm_dir: the tmpfs that holds the buffers (``/dev/shm``).
        verify_memory: what a load from memory checks: ``header`` (state, step,
            sequence number, crc32 of the layout and of the non-tensor state, the
            same step on every rank) or ``data`` (also crc32 of every byte, about
            2 GiB/s per core).
        throttle_mib_s: cap on the persist bandwidth per node in MiB/s (0: no cap),
            to leave disk bandwidth to the training job.
        wait_timeout_s: how long ``wait()`` waits for a step to be committed.
        reserve_mib: size of the tensor data of one save in MiB, declared up front: the
            buffers are laid out for it in the background when the saver is created.
            0 (default): from the state dict ``load()`` restores into (with the state a
            fresh optimizer will create), or at the first save.
        replicas: copies of each node's newest saves kept in other nodes' memory (0 or
            1): after a save, the node's persister copies it asynchronously to the next
            node of the ring, so losing a node loses no saved step (:mod:`.replica`).
        replica_transport: how a replica travels: ``tcp`` (default: one connection
            from the source node's persister, received straight into the peer's
            buffer; when it cannot connect, Ray's object store for that peer from
            then on) or ``ray`` (always Ray's object store: nodes whose ephemeral ports
            are closed to each other) (:mod:`.replica_stream`).
    """

    persist_every_steps: int = spec_field(1, ge=1)
    slots: int = spec_field(2, ge=1, le=8, allowed="an integer from 1 to 8")
    shm_dir: str = spec_field("/dev/shm", valid=lambda v, _: v.startswith("/"),
                              allowed="an absolute directory path on a tmpfs, e.g. /dev/shm")
    verify_memory: str = spec_field("header", choices=VERIFY_MODES,
                                    allowed=" or ".join(VERIFY_MODES))
    throttle_mib_s: float = spec_field(0.0, ge=0, note="0: no cap")
    wait_timeout_s: float = spec_field(600.0, ge=1e-3, allowed="a number of seconds > 0")
    reserve_mib: float = spec_field(0.0, ge=0, unit="a number of MiB", note="0: from the state")
    replicas: int = spec_field(0, ge=0, le=1, allowed="0 (no replica) or 1 (one copy in a "
                                                      "peer node's memory)")
    replica_transport: str = spec_field("tcp", choices=REPLICA_TRANSPORTS,
                                        allowed=" or ".join(REPLICA_TRANSPORTS))

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> FlashOptions:
        """Validate ``checkpoint.options`` (each field's type and range, declared with
        it: :mod:`dlrover_core.spec.fields`).

        Raises:
            SpecError: an unknown key, or a value of the wrong type or range; the message
                names ``checkpoint.options.<key>``, the value and what is allowed.
        """
        options = dict(options or {})
        key = "checkpoint.options"
        refuse_unknown(options, sorted(f.name for f in fields(cls)), key,
                       "unknown option of the flash saver")
        out = cls(**read_fields(cls, options, key))
        check_fields(out, cls, key)
        return out

    def is_due(self, step: int) -> bool:
        """Whether ``step`` is persisted by the regular schedule."""
        return step % self.persist_every_steps == 0


def local_dir(location: str) -> str:
    """``dir`` as a local path: a path, or a ``file://`` URI (an NFS-like mount).

    Raises:
        SpecError: another URI (the persisters commit by rename and O_EXCL locks on a
            file system every node mounts; the disk saver takes other fsspec stores).
    """
    from dlrover_core.checkpoint.storage import local_path

    try:
        path = local_path(location)
    except ValueError as exc:
        raise SpecError("checkpoint.dir", location, "a path or file:///path", str(exc)) from None
    if path is None:
        raise SpecError("checkpoint.dir", location, "a path or file:///path",
                        "the flash saver persists to a file system every node mounts; "
                        "other fsspec stores work with checkpoint.saver=disk")
    return path
