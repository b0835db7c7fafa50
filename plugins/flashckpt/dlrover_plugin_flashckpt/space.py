"""Free space of the shared-memory filesystem the flash buffers live in, and the
error that names what is missing and how to get more."""

from __future__ import annotations

import shutil


class ShmSpaceError(MemoryError):
    """The shared-memory filesystem has too little free space for the buffers."""


def shm_free_bytes(shm_dir: str) -> int:
    return shutil.disk_usage(shm_dir).free


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_space(shm_dir: str, needed: int, what: str) -> None:
    """Raise ``ShmSpaceError`` when ``shm_dir`` has less than ``needed`` bytes free.

    The message says how much is needed, how much is free and how to get more.
    """
    free = shm_free_bytes(shm_dir)
    if needed > free:
        raise ShmSpaceError(
            f"flash checkpoint needs {gib(needed)} of shared memory in {shm_dir} for {what}, "
            f"but only {gib(free)} is free: enlarge {shm_dir} (docker run --shm-size, a "
            "Memory-medium emptyDir on Kubernetes), free it (`dlrover flash clean`), or set "
            "checkpoint.options.slots=1 to halve the need")

