"""Semantic checks of a job spec beyond its types (:func:`validate`), run by
:func:`dlrover_core.spec.loader.load_spec` before anything starts; every error is a
:class:`SpecError` naming the key, the bad value and what is allowed. A field's own
range and choices are declared with it in :mod:`dlrover_core.spec.schema` and checked
by :func:`dlrover_core.spec.fields.check_fields`; what is here is what needs more than
one field, the plugins or the graph.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.fields import check_fields
from dlrover_core.spec.schema import JobSpec, RoleSpec

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_ROLE = re.compile(r"^[a-z][a-z0-9_]*$")


def _validate_backend_role(backend: Any, role: str, r: DictConfig, job_config: Any) -> None:
    """Run a backend's ``validate_role`` (its own checks of a role, e.g. parallel sizes)."""
    role_spec = OmegaConf.to_container(r, resolve=True)
    config = OmegaConf.to_container(OmegaConf.merge(job_config, r.config or {}), resolve=True)
    try:
        backend.validate_role(role, role_spec, config)
    except SpecError:
        raise
    except (ValueError, TypeError) as exc:
        raise SpecError(f"roles.{role}.backend", r.backend,
                        f"a role that backend {backend.name!r} can run", str(exc)) from None


def validate(spec: DictConfig, plugin_manager: Any = None) -> None:
    """Semantic checks beyond types. Raises :class:`SpecError`."""
    from dlrover_core.graph.graph import ComputationGraph
    from dlrover_core.plugins.manager import UnknownPluginError, get_plugin_manager

    pm = plugin_manager or get_plugin_manager()
    try:
        name = spec.name
    except MissingMandatoryValue:
        raise SpecError("name", None, "a job name (letters, digits, '_', '-', '.')",
                        "missing") from None
    if not isinstance(name, str) or not _NAME.match(name):
        raise SpecError("name", name, "letters, digits, '_', '-', '.'; starting with a letter or digit")
    if not spec.roles:
        raise SpecError("roles", {}, "at least one role, e.g. roles.trainer.workload=pkg.mod:Class")
    if spec.dl_type == "RL" and "actor" not in spec.roles:
        raise SpecError("roles.actor", None, "an actor role in an RL job, e.g. "
                        ".actor(module, class) or roles.actor.workload=pkg.mod:Class",
                        "the actor is mandatory in dl_type RL; roles given: "
                        + ", ".join(spec.roles))
    for role, r in spec.roles.items():
        k = f"roles.{role}"
        if not _ROLE.match(role):
            raise SpecError(k, role, "role names of lower-case letters, digits and '_'")
        try:
            workload = r.workload
        except MissingMandatoryValue:
            raise SpecError(f"{k}.workload", None, "an import path 'package.module:Class'",
                            "missing") from None
        if not isinstance(workload, str) or not _IMPORT_PATH.match(workload):
            raise SpecError(f"{k}.workload", workload, "an import path 'package.module:Class'")
        check_fields(r, RoleSpec, k)  # total, per_node, resources
        per_node = r.per_node or r.total
        if r.total % per_node:
            raise SpecError(f"{k}.per_node", r.per_node,
                            f"a divisor of total={r.total} "
                            f"({', '.join(str(d) for d in range(1, r.total + 1) if r.total % d == 0)})",
                            f"total {r.total} is not divisible by per_node {r.per_node}")
        dev = "cpu" if spec.device_type == "CPU" else "gpu"
        need = per_node * r.resources[dev]
        if spec.device_per_node and need > spec.device_per_node:
            raise SpecError(f"{k}.per_node", r.per_node,
                            f"at most device_per_node={spec.device_per_node} "
                            f"{spec.device_type}s per node",
                            f"{per_node} instances x resources.{dev}={r.resources[dev]:g} "
                            f"need {need:g} {spec.device_type}s on one node")
        if spec.node_num and r.total > spec.node_num * per_node:
            raise SpecError(f"{k}.total", r.total,
                            f"at most node_num x per_node = {spec.node_num} x {per_node} = "
                            f"{spec.node_num * per_node}")
        if r.backend is not None:
            try:
                backend = pm.get_backend(r.backend)
            except UnknownPluginError as exc:
                raise SpecError(f"{k}.backend", r.backend, "an installed backend", str(exc)) from None
            if backend.validate_role is not None:
                _validate_backend_role(backend, role, r, spec.config)
    if spec.driver is not None and not _IMPORT_PATH.match(spec.driver):
        raise SpecError("driver", spec.driver, "an import path 'package.module:Class'")
    try:
        pm.get_placement_policy(spec.placement)
    except UnknownPluginError as exc:
        raise SpecError("placement", spec.placement, "an installed placement policy", str(exc)) from None
    try:
        saver = pm.get_saver(spec.checkpoint.saver)
    except UnknownPluginError as exc:
        raise SpecError("checkpoint.saver", spec.checkpoint.saver, "an installed saver", str(exc)) from None
    if saver.validate_options is not None:
        options = OmegaConf.to_container(spec.checkpoint.options)
        try:
            saver.validate_options(options)
        except SpecError:
            raise
        except (ValueError, TypeError) as exc:
            raise SpecError("checkpoint.options", options,
                            f"options of saver {saver.name!r}", str(exc)) from None
    # checkpoint, failover, elastic, tuning (and its guard), observability, node_health:
    # each field's declared type, range and choices (spec_field in schema.py)
    check_fields(spec, JobSpec)
    from dlrover_core.spec.elastic import validate_elastic

    validate_elastic(spec)
    from dlrover_core.tuning.spec import validate_tuning

    validate_tuning(spec, pm)
    from dlrover_core.observability.spec import validate_observability

    validate_observability(spec)
    from dlrover_core.spec.node_health import validate_node_health

    validate_node_health(spec)
    for i, group in enumerate(spec.collocation):
        if not OmegaConf.is_list(group):
            raise SpecError(f"collocation[{i}]", group, "a list of role names")
    for i, edge in enumerate(spec.edges):
        if not OmegaConf.is_list(edge):
            raise SpecError(f"edges[{i}]", edge, "a pair [src_role, dst_role]")
    ComputationGraph.from_spec(spec)  # edges, cycles, collocation
