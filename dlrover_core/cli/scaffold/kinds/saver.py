"""The ``saver`` kind of ``dlrover plugin new``: its files and what it provides."""

from __future__ import annotations

from dlrover_core.cli.scaffold.kinds.base import Kind

_SAVER_PLUGIN = '''\
"""Entry point of the ``__NAME__`` plugin: the ``__NAME__`` checkpoint saver."""

from __future__ import annotations

from dlrover_core import CheckpointSaver, hookimpl


def validate_options(options: dict) -> None:
    """Check ``checkpoint.options`` when the spec loads (before anything starts).

    Raises:
        ValueError: an option this saver does not know, naming it and the allowed ones.
    """
    allowed = {"fsync"}
    for key in options:
        if key not in allowed:
            raise ValueError(f"checkpoint.options.{key}: unknown option of saver "
                             f"'__NAME__'; allowed: {', '.join(sorted(allowed))}")


@hookimpl
def dlrover_checkpoint_savers() -> list[CheckpointSaver]:
    return [CheckpointSaver(name="__NAME__", saver="__PKG__.saver:__CLASS__Saver",
                            validate_options=validate_options,
                            description="one torch.save file per rank, committed atomically")]
'''

_SAVER_IMPL = '''\
"""The ``__NAME__`` saver: one ``torch.save`` file per rank under ``<dir>/step_<n>/``.

Commit protocol: each rank writes ``rank_<k>.pt`` through a temporary file and an
atomic rename; after a barrier rank 0 writes ``manifest.json`` (size and sha256 of
every file) atomically; a step counts as committed once its manifest exists, and is
verified against it before it is loaded (a corrupt step is skipped, the next older one
is used). Replace ``_write``/``_read`` to store elsewhere.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from dlrover_core.checkpoint.manifest import MANIFEST, CorruptCheckpointError, build_manifest, verify
from dlrover_core.checkpoint.saver import Saver, atomic_write_json, prune, step_dir_name

log = logging.getLogger(__name__)


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _copy_into(dst: dict, src: dict) -> None:
    """Load ``src`` into ``dst`` in place: tensors are copied, other values replaced."""
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _copy_into(dst[key], value)
        elif isinstance(value, torch.Tensor) and isinstance(dst.get(key), torch.Tensor):
            dst[key].copy_(value)
        else:
            dst[key] = value


class __CLASS__Saver(Saver):
    def _path(self, step: int, rank: int) -> str:
        return os.path.join(self.config.dir, step_dir_name(step), f"rank_{rank:05d}.pt")

    def _write(self, path: str, state_dict: dict) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            torch.save(state_dict, f)
            if self.config.options.get("fsync", True):
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def _read(self, path: str) -> dict:
        return torch.load(path, map_location="cpu", weights_only=False)

    def save(self, step: int, state_dict: dict) -> None:
        path = self._path(step, self.context.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._write(path, state_dict)
        _barrier()
        if self.context.rank == 0:
            step_dir = os.path.dirname(path)
            manifest = build_manifest(step_dir, step, {"world_size": self.context.world_size,
                                                       "format": "__NAME__"})
            atomic_write_json(os.path.join(step_dir, MANIFEST), manifest)
            prune(self.config.dir, self.config.keep)
        _barrier()

    def load(self, state_dict: dict, step: int | None = None) -> int | None:
        candidates = [step] if step is not None else self.committed_steps()[::-1]
        for s in candidates:
            try:
                verify(os.path.dirname(self._path(s, 0)))
            except CorruptCheckpointError as exc:
                log.warning("skipping checkpoint step %d: %s", s, exc)
                continue
            _copy_into(state_dict, self._read(self._path(s, self.context.rank)))
            return s
        return None

    def close(self) -> None:
        """Nothing to release: every save is complete when ``save`` returns."""

    def describe(self) -> dict[str, Any]:
        return {"dir": self.config.dir, "keep": self.config.keep}
'''

_SAVER_TEST = '''\
"""The ``__NAME__`` saver: round trip, atomic commit, corruption, retention, options."""

from __future__ import annotations

import os

import pytest
import torch

from dlrover_core import SpecError, load_spec
from dlrover_core.checkpoint.saver import SaverConfig, SaverContext
from dlrover_core.plugins.records import resolve


def _saver(tmp_path, keep=3):
    cls = resolve("__PKG__.saver:__CLASS__Saver")
    return cls(SaverConfig(dir=str(tmp_path / "ckpt"), keep=keep), SaverContext())


def test_round_trip_in_place(tmp_path):
    saver = _saver(tmp_path)
    saved = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "extra": {"step": 7}}
    saver.save(7, saved)
    into = {"model": {"w": torch.zeros(2, 3)}, "extra": {"step": 0}}
    assert saver.load(into) == 7
    assert torch.equal(into["model"]["w"], saved["model"]["w"])
    assert into["extra"]["step"] == 7
    assert saver.committed_steps() == [7]


def test_corrupt_newest_step_falls_back(tmp_path):
    saver = _saver(tmp_path)
    for step in (1, 2):
        saver.save(step, {"w": torch.full((4,), float(step))})
    newest = os.path.join(str(tmp_path / "ckpt"), "step_00000002", "rank_00000.pt")
    with open(newest, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"XXXX")
    into = {"w": torch.zeros(4)}
    assert saver.load(into) == 1
    assert into["w"].tolist() == [1.0] * 4


def test_keeps_the_newest_steps(tmp_path):
    saver = _saver(tmp_path, keep=2)
    for step in (1, 2, 3):
        saver.save(step, {"w": torch.ones(1)})
    assert saver.committed_steps() == [2, 3]


def test_unknown_option_fails_at_spec_load():
    with pytest.raises((SpecError, ValueError)) as exc:
        load_spec({"name": "s", "roles": {"trainer": {"workload": "a.b:C"}},
                   "checkpoint": {"saver": "__NAME__", "options": {"bogus": 1}}})
    assert "bogus" in str(exc.value)
'''

SAVER = Kind(
    name="saver", summary="A checkpoint saver: save, commit and load state dicts",
    provides=("saver:__NAME__",), hooks=("dlrover_checkpoint_savers",), deps=("torch>=2.4",),
    files={"__PKG__/plugin.py": _SAVER_PLUGIN, "__PKG__/saver.py": _SAVER_IMPL,
           "tests/test___NAME__.py": _SAVER_TEST},
    layout=(("__PKG__/saver.py", "`__CLASS__Saver`: per-rank files, atomic commit with a "
             "checksummed manifest"),),
    usage="In a job spec: `checkpoint: {saver: __NAME__, every_steps: 100, keep: 3}`; "
          "workloads save through `self.checkpointer`.\n")
