"""One rank of tests/test_checkpoint_disk.py's two-rank ``async_save`` case:
``URI RANK PORT``.

A gloo group of 2 all-reduces a parameter on the default group every step (as DDP's
gradient sync would) while the disk saver with ``async_save`` saves steps 2, 4 and 6
in the background; the parameter changes right after each save returns. Step 8 holds
a value that cannot be pickled on rank 1 only: its background write fails. Prints one
JSON line: the steps committed, the error each rank's ``wait`` raised, and whether
steps 4 and 6 load bit-equal to the values at their save."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from dlrover_core.checkpoint import SaverConfig, SaverContext
from dlrover_core.checkpoint.disk import DiskSaver
from dlrover_core.testing import end_rank_process


def main() -> None:
    uri, rank, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2)
    saver = DiskSaver(SaverConfig(dir=uri, keep=2, options={"async_save": True}),
                      SaverContext(rank=rank, world_size=2, distributed=True))
    param = torch.arange(256, dtype=torch.float32) + rank
    saved: dict[int, torch.Tensor] = {}
    for step in range(1, 7):
        dist.all_reduce(param)           # the training's collective, main thread
        param /= 2
        if step % 2 == 0:
            saver.save(step, {"param": param, f"own{rank}": param * rank, "step": step})
            saved[step] = param.clone()
            param.add_(1000.0)           # changed while the save is in flight
    error = ""
    bad = {"param": param, "step": 8}
    if rank == 1:
        bad["fn"] = lambda: 0            # cannot be pickled: this rank's write fails
    saver.save(8, bad)
    try:
        saver.wait()
    except BaseException as exc:         # noqa: BLE001 (reported to the test)
        error = type(exc).__name__
    loads = {}
    for step in (4, 6):
        got = {"param": torch.zeros(256), f"own{rank}": torch.zeros(256), "step": 0}
        loaded = saver.load(got, step)
        loads[step] = (loaded == step and got["step"] == step
                       and torch.equal(got["param"], saved[step])
                       and torch.equal(got[f"own{rank}"], saved[step] * rank))
    print(json.dumps({"rank": rank, "committed": saver.committed_steps(), "error": error,
                      "loads": loads}))
    saver.close()
    dist.destroy_process_group()
    end_rank_process()  # not the interpreter's teardown: see end_rank_process


if __name__ == "__main__":
    main()
