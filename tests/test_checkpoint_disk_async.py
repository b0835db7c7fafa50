"""The disk saver's ``async_save``: the state at ``save`` is what is committed, in the
background; a failed background write is raised by the next call and commits nothing;
two gloo ranks save while their main threads run collectives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dlrover_core.checkpoint import Checkpointer, SaverConfig, SaverContext
from dlrover_core.checkpoint.disk import DiskSaver
from dlrover_core.spec.errors import SpecError

HERE = os.path.dirname(os.path.abspath(__file__))


def make(directory: str, keep: int = 3) -> Checkpointer:
    saver = DiskSaver(SaverConfig(dir=directory, keep=keep, options={"async_save": True}),
                      SaverContext())
    return Checkpointer(saver, every_steps=1)


def model_and_opt(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    return m, opt


def train(m, opt) -> None:
    m(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def snapshot(m, opt) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    return [p.detach().clone() for p in m.parameters()] + [
        state[k][name].clone() for k in sorted(state) for name in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("uri", [False, True], ids=["path", "local-uri"])
def test_the_state_at_save_is_committed_while_training_goes_on(tmp_path, uri):
    directory = f"local://{tmp_path}/ck" if uri else str(tmp_path / "ck")
    ck = make(directory, keep=2)
    m, opt = model_and_opt(0)
    want = {}
    for step in range(1, 6):
        train(m, opt)
        ck.save(step, model=m, optimizer=opt, extra={"step": step})
        want[step] = snapshot(m, opt)
        with torch.no_grad():            # changed while the save is in flight
            for p in m.parameters():
                p.add_(100.0)
    ck.wait()
    assert ck.saver.committed_steps() == [4, 5]
    for step in (4, 5):
        m2, opt2 = model_and_opt(1)
        train(m2, opt2)
        extra = {"step": 0}
        assert ck.load(step, model=m2, optimizer=opt2, extra=extra) == step
        assert extra["step"] == step
        got = snapshot(m2, opt2)
        assert len(got) == len(want[step])
        assert all(torch.equal(a, b) for a, b in zip(got, want[step])), step
    ck.close()


def test_a_failed_background_write_is_raised_once_and_commits_nothing(tmp_path):
    ck = make(str(tmp_path / "ck"))
    m, opt = model_and_opt(0)
    ck.save(2, model=m, optimizer=opt)
    ck.save(4, model=m, optimizer=opt, extra={"fn": lambda: 0})  # cannot be pickled
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is one
        ck.wait()
    assert "pickle" in str(info.value).lower() or "lambda" in str(info.value)
    assert ck.saver.committed_steps() == [2]
    ck.wait()                                    # raised once: nothing in flight now
    ck.save(6, model=m, optimizer=opt)
    ck.close()
    assert ck.saver.committed_steps() == [2, 6]
    assert not [n for n in os.listdir(tmp_path / "ck") if n.endswith(".tmp")]


def test_two_gloo_ranks_save_in_the_background_during_collectives(tmp_path):
    script = os.path.join(HERE, "async_ckpt_rank.py")
    for i, uri in enumerate((str(tmp_path / "ck"), f"local://{tmp_path}/store")):
        store = str(tmp_path / f"pg{i}")  # the group's file store (no port to race for)
        procs = [subprocess.Popen([sys.executable, script, uri, str(r), store],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_, errs) in zip(procs, outs):
            assert p.returncode == 0, errs[-3000:]
        rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
        for row in rows:
            assert row["committed"] == [4, 6], (uri, row)   # keep=2; step 8 failed
            assert row["error"], (uri, row)                  # every rank's wait raised
            assert row["loads"] == {"4": True, "6": True}, (uri, row)


def test_bad_options_are_refused_before_the_job_starts():
    from dlrover_core import load_spec

    base = {"name": "x", "roles": {"t": {"workload": "m:C", "total": 1}}}
    for options, text in (({"async_save": "yes"}, "async_save='yes'"),
                          ({"asnyc_save": True}, "asnyc_save")):
        with pytest.raises(SpecError, match="checkpoint.options") as info:
            load_spec({**base, "checkpoint": {"saver": "disk", "options": options}})
        assert text in str(info.value)


def _job(name: str, job_dir: str, **config):
    from dlrover_core import load_spec

    return load_spec({
        "name": name,
        "roles": {"trainer": {"workload": "tests.async_save_workloads:SaveAndReturn",
                              "total": 1, "resources": {"cpu": 1}}},
        "checkpoint": {"saver": "disk", "dir": os.path.join(job_dir, "ck"),
                       "options": {"async_save": True}},
        "failover": {"max_restarts": 0},
        "node_health": {"skip_node_check": True},
        "config": config})


def test_a_run_ends_after_its_last_save_is_committed(ray_cluster, job_dir):
    """``run()`` returns while its save is written: the step is committed before the
    run counts as done, and a failed write fails the run (it is not dropped)."""
    from dlrover_core.checkpoint.saver import committed_steps
    from dlrover_core.testing import run_job

    summary = run_job(_job("async-final", job_dir), job_dir)
    assert summary["status"] == "succeeded", summary["error"]
    assert committed_steps(os.path.join(job_dir, "ck", "trainer")) == [3]
    bad_dir = os.path.join(job_dir, "bad")
    summary = run_job(_job("async-final-bad", bad_dir, unpicklable=True), bad_dir)
    assert summary["status"] == "failed"
    assert "pickle" in str(summary["error"]).lower(), summary["error"]
    assert committed_steps(os.path.join(bad_dir, "ck", "trainer")) == []
