"""The signals the straggler detector and the tuner get (docs/node-health.md,
``dlrover_core.tuning.metrics``): DDP's gradient all-reduce timed per rank by the comm
hook, the reporting layer filling in ``compute_s``/``comm_wait_s`` for a loop that
times nothing, ``StepTimer`` keeping the wait out of ``compute_s``, the detector
comparing ranks on compute and on wait, and every rank's phases in the tuner's window.

The DDP test is two real processes in a gloo group (no Ray): rank 1 is late for every
all-reduce (it sleeps before its backward: the slowness this test measures, not a
timing of the workload). The end-to-end test (a gloo DDP job under Ray, rank 1 slowed
from outside by SIGSTOP/SIGCONT) is ``tests/test_node_health.py``'s straggler part.
"""

from __future__ import annotations

import multiprocessing
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from dlrover_core.master.stragglers import StragglerDetector, slow_ranks
from dlrover_core.spec.node_health import NodeHealthSpec
from dlrover_core.tuning.metrics import CommWaitMeter, StepClock
from dlrover_core.tuning.tuner import WindowSummary

LATE_S = 0.15  # how late rank 1 is for each all-reduce
STEPS = 6


def _rank(rank: int, port: int, out: multiprocessing.Queue) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from dlrover_core.runtime.reporting import StepReporter
    from dlrover_core.tuning.metrics import COMM_WAIT, StepTimer, measure_comm_wait

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(rank)  # different data per rank; DDP syncs the initial weights
    model = measure_comm_wait(torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                            torch.nn.Linear(256, 64))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sent: list[tuple[int, dict]] = []
    reporter = StepReporter(lambda step, m, ts: sent.append((step, m)), rank=0,
                            interval_s=1.0)
    timer = StepTimer()
    timed = []
    reporter.report(0, {"samples": 8.0})  # the first report: before any backward
    for step in range(1, STEPS + 1):
        x = torch.randn(8, 64)
        with timer.phase("compute"):
            loss = model(x).square().mean()
            if rank == 1:
                time.sleep(LATE_S)
            loss.backward()
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        timed.append(timer.end_step(samples=16))
        reporter.report(step, {"samples": 8.0})
    weights = [p.detach().clone() for p in model.parameters()]
    gathered = [None, None]
    dist.all_gather_object(gathered, weights)
    same = all(torch.equal(a, b) for a, b in zip(*gathered))
    dist.destroy_process_group()
    out.put((rank, {"sent": sent, "timed": timed, "count": COMM_WAIT.count,
                    "same_weights": same}))


@pytest.fixture(scope="module")
def ddp_ranks():
    from dlrover_core.ports import free_port

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.time() + 120
    try:
        while len(got) < len(procs):
            assert time.time() < deadline, "the ranks did not finish in 120 s"
            try:
                rank, res = out.get(timeout=1)
                got[rank] = res
            except Exception:  # noqa: BLE001 - queue.Empty: is a rank dead?
                assert all(p.is_alive() or p.exitcode == 0 for p in procs), \
                    [p.exitcode for p in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def test_the_hook_times_each_ranks_wait_and_keeps_ddp_s_all_reduce(ddp_ranks):
    r0, r1 = ddp_ranks[0], ddp_ranks[1]
    assert r0["same_weights"] and r1["same_weights"]  # the hook's all-reduce is DDP's mean
    assert r0["count"] == r1["count"] == STEPS  # one measured wait per backward
    # the reporting layer filled in what the loop never timed (not the first report)
    assert "comm_wait_s" not in r0["sent"][0][1]
    for rank in (r0, r1):
        assert [s for s, _ in rank["sent"]] == list(range(STEPS + 1))
        assert all({"step_s", "comm_wait_s", "compute_s"} <= set(m) for _, m in rank["sent"][1:])
    # rank 0 waits for the late rank 1; rank 1 hardly waits and does the longer work
    w0 = sorted(m["comm_wait_s"] for _, m in r0["sent"][2:])
    w1 = sorted(m["comm_wait_s"] for _, m in r1["sent"][2:])
    c0 = sorted(m["compute_s"] for _, m in r0["sent"][2:])
    c1 = sorted(m["compute_s"] for _, m in r1["sent"][2:])
    assert w0[len(w0) // 2] > LATE_S / 2 > w1[len(w1) // 2], (w0, w1)
    assert c1[len(c1) // 2] > LATE_S / 2 > c0[len(c0) // 2], (c0, c1)
    # StepTimer: the wait inside the backward is comm_wait_s, not compute_s
    t0 = sorted(m["compute_s"] for m in r0["timed"][1:])
    t1 = sorted(m["compute_s"] for m in r1["timed"][1:])
    assert all("comm_wait_s" in m for m in r0["timed"])
    assert t1[len(t1) // 2] > LATE_S / 2 > t0[len(t0) // 2], (t0, t1)
    assert sorted(m["comm_wait_s"] for m in r0["timed"][1:])[2] > LATE_S / 2


def test_the_clock_adds_nothing_without_the_hook_or_before_a_second_step():
    meter = CommWaitMeter()
    clock = StepClock(meter)
    assert clock.fill(0, {"loss": 1.0}) == {"loss": 1.0}
    assert clock.fill(1, {"loss": 1.0}) == {"loss": 1.0}  # the hook never ran
    meter.count, meter._total = 2, 1.0  # as after two measured backward passes
    out = clock.fill(3, {"data_wait_s": 0.01})  # two steps since: per step
    assert out["comm_wait_s"] == pytest.approx(0.5)
    assert out["compute_s"] == pytest.approx(max(0.0, out["step_s"] - 0.51))
    assert clock.fill(3, {}) == {}  # the step did not advance (a restart): nothing
    assert "compute_s" in clock.fill(4, {})


def test_slow_ranks_needs_the_low_wait_of_the_rank_others_wait_for():
    med = {0: {"compute_s": 0.05, "wait_s": 0.20}, 1: {"compute_s": 0.25, "wait_s": 0.01}}
    assert set(slow_ranks(med, 2.0)) == {1}
    # high compute but it also waits longest: the others do not wait for it
    med[1]["wait_s"] = 0.30
    assert slow_ranks(med, 2.0) == {}
    med[0]["wait_s"] = None  # a wait not known for every rank: compute alone decides
    assert set(slow_ranks(med, 2.0)) == {1}


def test_the_detector_uses_the_measured_wait():
    emitted: list = []
    spec = OmegaConf.create({"node_health": vars(NodeHealthSpec(
        straggler_action="report", straggler_window_s=1.0, straggler_windows=1))})
    inst = SimpleNamespace(node_id="n1", pid=42, last_step=7, attempt=0, state="running")
    det = StragglerDetector(SimpleNamespace(
        spec=spec, failover=SimpleNamespace(last_recovery_end=0.0),
        instances=SimpleNamespace(get=lambda role, rank: inst),
        emit=lambda event, **f: emitted.append((event, f))))
    for step in range(3):  # what StepClock reports: rank 1 is the one waited for
        det.on_report("trainer", 0, step, {"step_s": 0.3, "compute_s": 0.05,
                                           "comm_wait_s": 0.2})
        det.on_report("trainer", 1, step, {"step_s": 0.3, "compute_s": 0.29,
                                           "comm_wait_s": 0.01})
    det.check(now=det._window_start + 1.01)
    found = [f for e, f in emitted if e == "straggler_detected"]
    assert [f["rank"] for f in found] == [1]
    ranks = found[0]["evidence"][0]["ranks"]
    assert ranks["0"]["wait_s"] == pytest.approx(0.2)  # comm_wait_s, not step - compute
    assert ranks["1"]["wait_s"] == pytest.approx(0.01)


def test_the_tuner_window_has_every_ranks_phases():
    rank0 = [(s, {"samples": 16.0, "interval_s": 0.2, "data_wait_s": 0.0,
                  "compute_s": 0.05, "optimizer_s": 0.01, "comm_wait_s": 0.14})
             for s in range(10)]
    rank1 = [{"data_wait_s": 0.15, "compute_s": 0.04, "optimizer_s": 0.01,
              "comm_wait_s": 0.0}] * 3  # a stalled loader on rank 1 (coalesced reports)
    w = WindowSummary.from_reports(1, rank0, {}, {}, 2, phases_by_rank={1: rank1})
    assert w.ranks["1"]["data_wait_s"] == pytest.approx(0.15)
    assert w.ranks["0"]["reports"] == 10 and w.ranks["1"]["reports"] == 3
    assert w.data_wait_s == pytest.approx(0.15)  # rank 1's stall, not rank 0's compute
    assert w.data_wait_share == pytest.approx(0.75)
    assert w.compute_s == pytest.approx(0.05)
    merged = WindowSummary.merge([w, w])
    assert merged.ranks["1"]["data_wait_s"] == pytest.approx(0.15)
    assert WindowSummary.from_dict(merged.as_dict()).ranks == merged.ranks
    alone = WindowSummary.from_reports(1, rank0, {}, {}, 2)  # rank 0's only, as before
    assert alone.data_wait_share == 0.0 and alone.compute_s == pytest.approx(0.05)


def test_the_tuning_controller_takes_every_ranks_phases():
    """Rank 1's loader stalls; rank 0 waits for it inside the all-reduce (its
    ``comm_wait_s``). The window the tuners get names rank 1's data wait, which rank 0's
    reports alone never show."""
    from dlrover_core.tuning.builtin_tuners import DataloaderWorkersTuner
    from dlrover_core.tuning.controller import TuningController

    events: list = []
    ctl = TuningController([("dataloader_workers", DataloaderWorkersTuner({}))],
                           role="trainer", world_size=2, interval_steps=4, warmup_steps=1,
                           store=None, emit=lambda e, **f: events.append((e, f)),
                           one_change_per_round=False)
    ctl.sync("trainer", 0, {"dataloader": {"batch_size": 4, "num_workers": 0}})
    common = {"tuning_version": 0, "samples": 8.0, "interval_s": 0.2, "step_s": 0.2,
              "optimizer_s": 0.0}
    for step in range(12):
        ctl.on_report("trainer", 1, step, {**common, "data_wait_s": 0.15,
                                           "compute_s": 0.05, "comm_wait_s": 0.0})
        ctl.on_report("trainer", 0, step, {**common, "data_wait_s": 0.0,
                                           "compute_s": 0.05, "comm_wait_s": 0.15})
    windows = [f["window"] for e, f in events if isinstance(f.get("window"), dict)]
    summaries = windows or [w.as_dict() for w in ctl.windows]
    assert summaries, events
    assert summaries[0]["ranks"]["1"]["data_wait_s"] == pytest.approx(0.15)
    assert summaries[0]["data_wait_share"] == pytest.approx(0.75)
