"""The ``template`` kind of ``dlrover plugin new``: its files and what it provides."""

from __future__ import annotations

from dlrover_core.cli.scaffold.kinds.base import Kind

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
