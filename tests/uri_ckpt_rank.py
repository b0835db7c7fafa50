"""One rank of tests/test_checkpoint_uri.py's two-rank case: ``MODE URI RANK STORE``
(STORE: a new file, the gloo group's file store).

``save``: a gloo group of 2, a state with a tensor of its own per rank
(``r<rank>``) and a shared one, saved as step 5 by the disk saver to ``URI``.
``load``: loads into zeros and checks every value; prints ``loaded <step>``."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from dlrover_core.checkpoint import SaverConfig, SaverContext
from dlrover_core.checkpoint.disk import DiskSaver
from dlrover_core.testing import end_rank_process


def state(rank: int, fill: bool) -> dict:
    def t(v: float) -> torch.Tensor:
        return torch.full((64,), v) if fill else torch.zeros(64)

    return {"shared": t(7.0), f"r{rank}": t(float(rank + 1))}


def main() -> None:
    mode, uri, rank, store = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2)
    saver = DiskSaver(SaverConfig(dir=uri), SaverContext(rank=rank, world_size=2,
                                                         distributed=True))
    if mode == "save":
        saver.save(5, state(rank, True))
        print("saved")
    else:
        got = state(rank, False)
        step = saver.load(got)
        want = state(rank, True)
        assert all(torch.equal(got[k], want[k]) for k in want), got
        print(f"loaded {step}")
    dist.destroy_process_group()
    end_rank_process()  # not the interpreter's teardown: see end_rank_process


if __name__ == "__main__":
    main()
