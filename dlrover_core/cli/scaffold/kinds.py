"""What each kind of scaffolded plugin contains, beyond :mod:`.common`.

Each :class:`Kind` lists its files (path -> text with the placeholders of
:mod:`dlrover_core.cli.scaffold.common`), what ``dlrover plugins list`` will show it
providing, the hooks it implements, and its extra requirements.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Kind:
    """One ``--kind`` of ``dlrover plugin new``."""

    name: str
    summary: str
    provides: tuple[str, ...]
    hooks: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)
    deps: tuple[str, ...] = ()
    layout: tuple[tuple[str, str], ...] = ()
    usage: str = ""


# =========================================================================== backend
_BACKEND_PLUGIN = '''\
"""Entry point of the ``__NAME__`` plugin: the ``__NAME__`` SPMD backend.

Imports nothing heavy: the session class is named by its import path and imported in
the worker process that uses it.
"""

from __future__ import annotations

from dlrover_core import Backend, hookimpl


@hookimpl
def dlrover_backends() -> list[Backend]:
    return [Backend(name="__NAME__", session="__PKG__.session:__CLASS__Session",
                    state_dict_engine="plain",
                    description="DistributedDataParallel on the role's process group")]
'''

_BACKEND_SESSION = '''\
"""The worker-side half of the ``__NAME__`` backend.

``TorchDistributedSession`` (dlrover-core) joins the role's torch.distributed group at
its rendezvous (gloo on the CPU, NCCL on GPUs, ``failover.pg_timeout_s`` as the
collective timeout); this subclass decides how a model is wrapped. Change ``wrap``
(and ``setup`` for another runtime) to make it your backend.
"""

from __future__ import annotations

from typing import Any

import torch

from dlrover_core import BackendSession  # noqa: F401  (the base of every session)
from dlrover_core.runtime.backend import TorchDistributedSession


class __CLASS__Session(TorchDistributedSession):
    def wrap(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        """``DistributedDataParallel`` over the role's group; ``kwargs`` go to DDP.
        One rank: the model on this rank's device, unwrapped."""
        from torch.nn.parallel import DistributedDataParallel

        model = model.to(self.device)
        if self.context.world_size == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **kwargs)
'''

_BACKEND_WORKLOADS = '''\
"""A workload that checks the backend: its process group and its model wrapping."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dlrover_core import BaseWorkload


class Probe(BaseWorkload):
    def setup(self) -> None:
        torch.manual_seed(0)
        self.model = self.backend.wrap(torch.nn.Linear(4, 1))

    def all_reduce(self, value: float) -> float:
        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        return t.item()

    def weight_grad(self) -> list:
        """Gradient of sum(model(x)) for x filled with rank + 1 (2 samples): each rank's
        own gradient is 2 * (rank + 1); data parallelism averages it over the ranks."""
        x = torch.full((2, 4), float(self.rank + 1))
        self.model(x).sum().backward()
        module = getattr(self.model, "module", self.model)
        return module.weight.grad.tolist()
'''

_BACKEND_TEST = '''\
"""The ``__NAME__`` backend on two real ranks (gloo) in Ray actors."""

from __future__ import annotations

import pytest
import ray

from dlrover_core.testing import spawn_role


@pytest.fixture
def ranks(ray_cluster):
    handles = spawn_role("trainer", "tests.workloads:Probe", 2, backend="__NAME__",
                         job="__NAME__-test")
    yield handles
    for h in handles:
        ray.kill(h)


def test_process_group_joins_both_ranks(ranks):
    sums = ray.get([h.call.remote("all_reduce", r + 1) for r, h in enumerate(ranks)])
    assert sums == [3.0, 3.0]


def test_wrapped_model_averages_gradients(ranks):
    grads = ray.get([h.call.remote("weight_grad") for h in ranks])
    # rank 0 alone: 2.0, rank 1 alone: 4.0 -> averaged: 3.0 on both ranks
    assert grads[0] == grads[1] == [[3.0, 3.0, 3.0, 3.0]]


def test_registered_record(plugin_manager):
    backend = plugin_manager.get_backend("__NAME__")
    assert backend.provider == "__NAME__"
    assert backend.session == "__PKG__.session:__CLASS__Session"
'''

BACKEND = Kind(
    name="backend", summary="An SPMD backend: process group setup and model wrapping",
    provides=("backend:__NAME__",), hooks=("dlrover_backends",), deps=("torch>=2.4",),
    files={"__PKG__/plugin.py": _BACKEND_PLUGIN, "__PKG__/session.py": _BACKEND_SESSION,
           "tests/workloads.py": _BACKEND_WORKLOADS, "tests/test___NAME__.py": _BACKEND_TEST},
    layout=(("__PKG__/session.py", "`__CLASS__Session`: joins the role's process group "
             "and wraps models"),),
    usage="In a job spec: `roles.<role>.backend: __NAME__`; a workload gets the session as "
          "`self.backend` (`self.backend.wrap(model)`, `self.backend.device`).\n")

# =========================================================================== template
_TEMPLATE_PLUGIN = '''\
"""Entry point of the ``__NAME__`` plugin: the ``__NAME__`` graph template.

A required SPMD role ``trainer`` and an optional ``evaluator`` fed by it (edge
``trainer -> evaluator``), no driver. ``apply`` fills the template's defaults in
before the spec is validated.
"""

from __future__ import annotations

from typing import Any

from dlrover_core import GraphTemplate, RoleTemplate, SpecError, hookimpl


def apply___NAME_ID__(spec: Any) -> None:
    """Template defaults, applied in place to the job spec (a ``DictConfig``) before
    validation: an ``evaluator`` runs on one rank unless the job says otherwise.

    Raises:
        SpecError: the job names a driver (this template's roles run their own loops).
    """
    if spec.driver is not None:
        raise SpecError("driver", spec.driver, "no driver for template '__NAME__'",
                        "the trainer role runs its own loop (BaseWorkload.run)")
    if "evaluator" in spec.roles and spec.roles.evaluator.per_node == 0:
        spec.roles.evaluator.per_node = 1


@hookimpl
def dlrover_graph_templates() -> list[GraphTemplate]:
    return [GraphTemplate(
        name="__NAME__", description="an SPMD trainer and an optional evaluator",
        roles=(RoleTemplate("trainer", True, "SPMD training loop"),
               RoleTemplate("evaluator", False, "evaluates what the trainer produced")),
        edges=(("trainer", "evaluator"),), driver=None, apply=apply___NAME_ID__)]
'''

_TEMPLATE_WORKLOADS = '''\
"""A small workload to run a job of the template end to end."""

from __future__ import annotations

from dlrover_core import BaseWorkload


class Counter(BaseWorkload):
    def run(self) -> None:
        for step in range(int(self.config.get("max_steps", 3))):
            self.report(step, loss=1.0 / (step + 1))
'''

_TEMPLATE_TEST = '''\
"""The ``__NAME__`` template: validation, defaults and a real job."""

from __future__ import annotations

import pytest

from dlrover_core import SpecError, load_spec

W = "tests.workloads:Counter"


def test_roles_edges_and_defaults():
    spec = load_spec({"name": "t", "template": "__NAME__",
                      "roles": {"trainer": {"workload": W, "total": 1},
                                "evaluator": {"workload": W}}})
    assert [list(e) for e in spec.edges] == [["trainer", "evaluator"]]
    assert spec.roles.evaluator.per_node == 1


def test_missing_required_role_names_it():
    with pytest.raises(SpecError) as exc:
        load_spec({"name": "t", "template": "__NAME__",
                   "roles": {"evaluator": {"workload": W}}})
    assert "trainer" in str(exc.value)


def test_driver_is_refused():
    with pytest.raises(SpecError) as exc:
        load_spec({"name": "t", "template": "__NAME__", "driver": "x.y:Z",
                   "roles": {"trainer": {"workload": W}}})
    assert "driver" in str(exc.value)


def test_a_job_of_the_template_runs(ray_cluster, job_dir):
    from dlrover_core.master.client import submit_job

    spec = load_spec({"name": "__NAME__-job", "template": "__NAME__",
                      "roles": {"trainer": {"workload": W, "total": 1}},
                      "config": {"max_steps": 3}})
    summary = submit_job(spec, job_dir=job_dir, progress=False)
    assert summary["status"] == "succeeded", summary.get("error")
    assert summary["steps"] == 3
'''

TEMPLATE = Kind(
    name="template", summary="A graph template: the roles, edges and defaults of a job",
    provides=("template:__NAME__",), hooks=("dlrover_graph_templates",),
    files={"__PKG__/plugin.py": _TEMPLATE_PLUGIN, "tests/workloads.py": _TEMPLATE_WORKLOADS,
           "tests/test___NAME__.py": _TEMPLATE_TEST},
    usage="In a job spec: `template: __NAME__` and a `roles.trainer.workload`; "
          "`dlrover templates list` shows its roles.\n")

# =========================================================================== saver
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

# =========================================================================== placement
_PLACEMENT_PLUGIN = '''\
"""Entry point of the ``__NAME__`` plugin: the ``__NAME__`` placement policy."""

from __future__ import annotations

from dlrover_core import PlacementPolicy, hookimpl
from __PKG__.policy import plan


@hookimpl
def dlrover_placement_policies() -> list[PlacementPolicy]:
    return [PlacementPolicy(name="__NAME__", plan=plan,
                            description="one PACK placement group per role group")]
'''

_PLACEMENT_POLICY = '''\
"""The ``__NAME__`` placement policy: one Ray placement group with the ``PACK``
strategy per collocation group (Ray packs its bundles on as few nodes as it can but
may use more), bundle ``i`` hosting rank ``i`` of every role in the group.

Light: no Ray import here; the JobMaster creates the placement groups from the plan.
"""

from __future__ import annotations

from typing import Any

from dlrover_core.placement import (
    ClusterResources,
    InstanceSlot,
    PlacementError,
    PlacementGroupPlan,
    PlacementPlan,
)


def plan(graph: Any, cluster: ClusterResources) -> PlacementPlan:
    """Place ``graph`` (a ``ComputationGraph``) on ``cluster``.

    Raises:
        PlacementError: the job asks for more of a resource than the cluster has.
    """
    out = PlacementPlan()
    demand: dict[str, float] = {}
    for group in graph.groups:
        bundle: dict[str, float] = {}
        for role in group.roles:
            for key, value in graph.roles[role].resources.as_ray().items():
                bundle[key] = max(bundle.get(key, 0.0), value)
        bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}
        share = 1.0 / len(group.roles)  # collocated roles share each bundle
        index = len(out.groups)
        out.groups.append(PlacementGroupPlan("+".join(group.roles),
                                             [dict(bundle)] * group.size, "PACK"))
        for rank in range(group.size):
            for role in group.roles:
                if rank < graph.roles[role].total:
                    out.slots[(role, rank)] = InstanceSlot(
                        index, rank, {k: v * share for k, v in bundle.items()},
                        rank // group.per_node, rank % group.per_node, group.per_node)
        for key, value in bundle.items():
            demand[key] = demand.get(key, 0.0) + value * group.size
    for key, value in demand.items():
        if value > cluster.total(key) + 1e-9:
            raise PlacementError(f"the job needs {value:g} {key} but the cluster has "
                                 f"{cluster.total(key):g}; lower roles.*.total or add nodes")
    return out
'''

_PLACEMENT_TEST = '''\
"""The ``__NAME__`` placement policy on a graph from a real spec."""

from __future__ import annotations

import pytest

from dlrover_core import load_spec
from dlrover_core.graph.graph import ComputationGraph
from dlrover_core.placement import ClusterResources, NodeResources, PlacementError


def _graph(total: int, per_node: int = 0) -> ComputationGraph:
    spec = load_spec({"name": "p", "placement": "__NAME__",
                      "roles": {"trainer": {"workload": "a.b:C", "total": total,
                                            "per_node": per_node,
                                            "resources": {"cpu": 1}}}})
    return ComputationGraph.from_spec(spec)


def _cluster(*cpus: float) -> ClusterResources:
    return ClusterResources([NodeResources(f"n{i}", f"10.0.0.{i}", {"CPU": c})
                             for i, c in enumerate(cpus)])


def test_every_instance_has_a_bundle(plugin_manager):
    plan = plugin_manager.get_placement_policy("__NAME__").plan
    out = plan(_graph(4, per_node=2), _cluster(2, 2))
    assert [g.strategy for g in out.groups] == ["PACK"]
    assert out.groups[0].bundles == [{"CPU": 1.0}] * 4
    assert sorted(out.slots) == [("trainer", r) for r in range(4)]
    assert [out.slots[("trainer", r)].node_rank for r in range(4)] == [0, 0, 1, 1]


def test_too_big_for_the_cluster(plugin_manager):
    plan = plugin_manager.get_placement_policy("__NAME__").plan
    with pytest.raises(PlacementError, match="needs 4 CPU"):
        plan(_graph(4), _cluster(2))
'''

PLACEMENT = Kind(
    name="placement", summary="A placement policy: role instances onto Ray placement groups",
    provides=("placement:__NAME__",), hooks=("dlrover_placement_policies",),
    files={"__PKG__/plugin.py": _PLACEMENT_PLUGIN, "__PKG__/policy.py": _PLACEMENT_POLICY,
           "tests/test___NAME__.py": _PLACEMENT_TEST},
    layout=(("__PKG__/policy.py", "`plan(graph, cluster) -> PlacementPlan`"),),
    usage="In a job spec: `placement: __NAME__`.\n")

# =========================================================================== classifier
_CLASSIFIER_PLUGIN = '''\
"""Entry point of the ``__NAME__`` plugin: a failure classifier.

``dlrover_classify_failure`` is ``firstresult``: this plugin answers for the errors it
recognises and returns ``None`` for the others, which the built-in classifier (called
last) then decides.
"""

from __future__ import annotations

import re

from dlrover_core import Failure, FailureVerdict, hookimpl

#: (pattern searched in "exc_type: message", failover level, reason)
RULES: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"out of memory", re.I), "fatal",
     "the device ran out of memory; lower the micro-batch size or shard the model"),
    (re.compile(r"NCCL.*(timeout|timed out)|Watchdog caught collective", re.I), "process",
     "a collective timed out; restart the ranks of the group from the checkpoint"),
]


@hookimpl
def dlrover_classify_failure(failure: Failure, history: list[Failure]) -> FailureVerdict | None:
    text = f"{failure.exc_type}: {failure.message}"
    for pattern, level, reason in RULES:
        if pattern.search(text):
            return FailureVerdict(level=level, reason=reason)
    return None
'''

_CLASSIFIER_TEST = '''\
"""The ``__NAME__`` classifier answers for its errors, the built-in one for the rest.

The manager here holds the built-in plugin and this one only: other installed
classifiers may answer the same errors first (``firstresult``), which
``test_installed_...`` shows.
"""

from __future__ import annotations

import pytest

from dlrover_core import Failure
from dlrover_core.plugins.manager import PluginManager

import __PKG__.plugin as plugin

OOM = Failure(kind="user_error", role="trainer", rank=1, exc_type="torch.OutOfMemoryError",
              message="CUDA out of memory. Tried to allocate 2.00 GiB")
TIMEOUT = Failure(kind="user_error", role="trainer", rank=0,
                  exc_type="torch.distributed.DistBackendError",
                  message="[Rank 0] Watchdog caught collective operation timeout")


@pytest.fixture
def pm():
    manager = PluginManager(load_entry_points=False)
    manager.register(plugin, "__NAME__")
    return manager


@pytest.mark.parametrize("failure,level", [(OOM, "fatal"), (TIMEOUT, "process")])
def test_recognised_errors(pm, failure, level):
    verdict = pm.classify_failure(failure)
    assert (verdict.level, verdict.classifier) == (level, "__NAME__")


def test_other_errors_go_to_the_builtin(pm):
    verdict = pm.classify_failure(Failure(kind="actor_died", role="trainer", rank=0,
                                          message="the actor died unexpectedly"))
    assert verdict.classifier == "builtin"


def test_installed_through_its_entry_point(plugin_manager):
    info = {i.name: i for i in plugin_manager.plugins()}["__NAME__"]
    assert info.status == "active", info.error
    assert "dlrover_classify_failure" in info.hooks
'''

CLASSIFIER = Kind(
    name="classifier", summary="A failure classifier: errors it knows -> failover level",
    provides=(), hooks=("dlrover_classify_failure",),
    files={"__PKG__/plugin.py": _CLASSIFIER_PLUGIN, "tests/test___NAME__.py": _CLASSIFIER_TEST},
    usage="Installed, it is asked first about every failure of every job; the level it "
          "answers (`process`, `role`, `node`, `job`, `fatal`) is in `events.jsonl` "
          "(`failure_classified`, `classifier: __NAME__`).\n")

# =========================================================================== tuner
_TUNER_PLUGIN = '''\
\"\"\"Entry point of the ``__NAME__`` plugin: the ``__NAME__`` tuner.\"\"\"

from __future__ import annotations

from dlrover_core import Tuner, hookimpl


@hookimpl
def dlrover_tuners() -> list[Tuner]:
    return [Tuner(name="__NAME__", tuner="__PKG__.tuner:__CLASS__Tuner",
                  description="activation checkpointing on when memory runs short")]
'''

_TUNER_IMPL = '''\
\"\"\"The ``__NAME__`` tuner: switch FSDP2 activation checkpointing on when the memory
peak of the last window is above ``memory_share`` of the device's capacity; once the
guard reverted that, never propose it again in this job.

Runs in the master (and its option check in the client): imports nothing heavy.
\"\"\"

from __future__ import annotations

from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.tuner import TunerBase, WindowSummary


class __CLASS__Tuner(TunerBase):
    defaults = {"memory_share": 0.9}

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.gave_up = False

    @classmethod
    def validate_options(cls, options: dict) -> None:
        super().validate_options(options)
        share = options.get("memory_share", cls.defaults["memory_share"])
        if not 0.0 < share <= 1.0:
            raise ValueError(f"memory_share: {share!r} is invalid; allowed: a number in (0, 1]")

    def propose(self, window: WindowSummary, current: TuningConfig) -> dict | None:
        if self.gave_up or current.parallelism.activation_checkpointing:
            return None
        if window.memory_capacity_bytes <= 0:  # capacity unknown: nothing to compare with
            return None
        if window.memory_bytes > self.options["memory_share"] * window.memory_capacity_bytes:
            return {"parallelism": {"activation_checkpointing": True}}
        return None

    def feedback(self, change: dict, accepted: bool, before: WindowSummary,
                 after: WindowSummary | None) -> None:
        if not accepted:
            self.gave_up = True

    def state_dict(self) -> dict:
        return {"gave_up": self.gave_up}

    def load_state_dict(self, state: dict) -> None:
        self.gave_up = bool(state.get("gave_up", False))
'''

_TUNER_TEST = '''\
\"\"\"The ``__NAME__`` tuner: its proposals, the guard's feedback, its options.\"\"\"

from __future__ import annotations

import pytest

from dlrover_core import SpecError, load_spec
from dlrover_core.plugins.records import resolve
from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.tuner import WindowSummary

GIB = float(1 << 30)


def window(memory_gib: float, capacity_gib: float = 10.0) -> WindowSummary:
    return WindowSummary(version=0, steps=20, first_step=0, last_step=19, samples_per_s=500.0,
                         step_s=0.1, data_wait_s=0.01, compute_s=0.07, optimizer_s=0.02,
                         data_wait_share=0.1, memory_bytes=memory_gib * GIB,
                         memory_capacity_bytes=capacity_gib * GIB, prefetch_depth=-1.0,
                         world_size=2)


@pytest.fixture
def tuner(plugin_manager):
    record = plugin_manager.get_tuner("__NAME__")
    return resolve(record.tuner)({"memory_share": 0.8})


def test_proposes_activation_checkpointing_when_memory_is_short(tuner):
    change = tuner.propose(window(9.0), TuningConfig())
    assert change == {"parallelism": {"activation_checkpointing": True}}
    assert TuningConfig().updated(change, version=1).parallelism.activation_checkpointing
    assert tuner.propose(window(5.0), TuningConfig()) is None
    assert tuner.propose(window(9.0, capacity_gib=0.0), TuningConfig()) is None


def test_a_reverted_change_is_not_proposed_again(tuner):
    change = tuner.propose(window(9.0), TuningConfig())
    tuner.feedback(change, accepted=False, before=window(9.0), after=window(9.5))
    assert tuner.propose(window(9.0), TuningConfig()) is None
    restored = type(tuner)()
    restored.load_state_dict(tuner.state_dict())
    assert restored.propose(window(9.0), TuningConfig()) is None


@pytest.mark.parametrize("options,word", [({"memory_share": 1.5}, "memory_share"),
                                          ({"bogus": 1}, "bogus")])
def test_bad_options_fail_at_spec_load(options, word):
    with pytest.raises((SpecError, ValueError)) as exc:
        load_spec({"name": "t", "roles": {"trainer": {"workload": "a.b:C"}},
                   "tuning": {"enabled": True, "tuners": ["__NAME__"],
                              "options": {"__NAME__": options}}})
    assert word in str(exc.value)
'''

TUNER = Kind(
    name="tuner", summary="A tuner: step metrics -> a new versioned TuningConfig",
    provides=("tuner:__NAME__",), hooks=("dlrover_tuners",),
    files={"__PKG__/plugin.py": _TUNER_PLUGIN, "__PKG__/tuner.py": _TUNER_IMPL,
           "tests/test___NAME__.py": _TUNER_TEST},
    layout=(("__PKG__/tuner.py", "`__CLASS__Tuner`: `propose(window, current)` and "
             "`feedback(...)`"),),
    usage="In a job spec: `tuning: {enabled: true, tuners: [__NAME__], options: "
          "{__NAME__: {memory_share: 0.9}}}` (see the core's docs/tuning.md).\n")

KINDS: dict[str, Kind] = {k.name: k for k in (BACKEND, TEMPLATE, SAVER, PLACEMENT, CLASSIFIER,
                                              TUNER)}
