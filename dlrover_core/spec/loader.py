"""Load and validate a job spec: YAML file or dict, plus ``key=value`` overrides.

Everything here runs in the client before Ray starts; every error is a
:class:`SpecError` naming the key, the bad value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.schema import DL_TYPES, JobSpec, RoleSpec

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_ROLE = re.compile(r"^[a-z][a-z0-9_]*$")


def _schema_node(key: str) -> Any:
    """The schema dataclass (or field type) at a dotted key, for listing allowed keys."""
    node: Any = JobSpec
    for part in key.split(".")[:-1]:
        if node is JobSpec and part == "roles":
            node = "roles"
            continue
        if node == "roles":
            node = RoleSpec
            continue
        if dataclasses.is_dataclass(node):
            fields = {f.name: f for f in dataclasses.fields(node)}
            f = fields.get(part)
            if f is None:
                return None
            node = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            node = type(node) if dataclasses.is_dataclass(node) else None
        else:
            return None
    return node


def _convert(exc: OmegaConfBaseException, source: str) -> SpecError:
    key = getattr(exc, "full_key", None) or ""
    if isinstance(exc, (ConfigKeyError, ConfigAttributeError)):
        node = _schema_node(key)
        if dataclasses.is_dataclass(node):
            allowed = ", ".join(f.name for f in dataclasses.fields(node))
        else:
            allowed = "a key of the job schema"
        return SpecError(key, key.split(".")[-1], f"one of: {allowed}", f"unknown key in {source}")
    if isinstance(exc, MissingMandatoryValue):
        return SpecError(key, "???", "a value", f"missing mandatory value in {source}")
    if isinstance(exc, ValidationError):
        value = getattr(exc, "object_type_str", None)
        msg = str(exc).splitlines()[0]
        m = re.search(r"Value '(.*?)'", msg)
        value = m.group(1) if m else value
        m2 = re.search(r"could not be converted to (\w+)", msg) or re.search(
            r"to (\w+)$", msg)
        wanted = m2.group(1) if m2 else None
        words = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false",
                 "String": "a string"}
        allowed = words.get(wanted or "", f"a value of type {wanted}" if wanted
                            else "a value of the schema's type")
        return SpecError(key, value, allowed, f"{msg} in {source}")
    return SpecError(key or "<spec>", None, "a valid job spec", f"{exc} in {source}")


def load_spec(
    source: str | os.PathLike | dict | DictConfig,
    overrides: Iterable[str] = (),
    plugin_manager: Any = None,
) -> DictConfig:
    """Load, merge and validate a job spec.

    Args:
        source: a YAML path, a plain dict, or a ``DictConfig``.
        overrides: OmegaConf dot-list items such as ``roles.trainer.total=4``.
        plugin_manager: where to look up templates, backends, savers and placement
            policies (default: the process-wide manager).
    Returns:
        the validated spec, a ``DictConfig`` typed by :class:`JobSpec`.
    Raises:
        SpecError: anything invalid, before any process starts.
        FileNotFoundError: ``source`` is a path that does not exist.
    """
    from dlrover_core.plugins.manager import UnknownPluginError, get_plugin_manager

    pm = plugin_manager or get_plugin_manager()
    schema = OmegaConf.structured(JobSpec)
    label = "the job spec"
    if isinstance(source, (str, os.PathLike)):
        label = str(source)
        if not os.path.exists(source):
            raise FileNotFoundError(f"job spec {str(source)!r} does not exist")
        try:
            raw = OmegaConf.load(source)
        except Exception as exc:  # yaml errors
            raise SpecError("<file>", str(source), "a YAML mapping", str(exc)) from None
    else:
        raw = OmegaConf.create(source if not isinstance(source, DictConfig)
                               else OmegaConf.to_container(source))
    if not isinstance(raw, DictConfig):
        raise SpecError("<file>", type(raw).__name__, "a YAML mapping at the top level")
    try:
        spec = OmegaConf.merge(schema, raw)
    except OmegaConfBaseException as exc:
        raise _convert(exc, label) from None
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item:
            raise SpecError("<override>", item, "key=value (OmegaConf dot-list)")
    if overrides:
        try:
            spec = OmegaConf.merge(spec, OmegaConf.from_dotlist(overrides))
        except OmegaConfBaseException as exc:
            raise _convert(exc, "the overrides") from None

    template_name = spec.template
    if template_name is None and spec.driver is None:
        if spec.dl_type not in DL_TYPES:
            raise SpecError("dl_type", spec.dl_type, ", ".join(DL_TYPES))
    if template_name:
        try:
            template = pm.get_template(template_name)
        except UnknownPluginError as exc:
            raise SpecError("template", template_name, "an installed graph template",
                            str(exc)) from None
        _apply_template(spec, template)
    _apply_devices(spec)
    validate(spec, pm)
    return spec


def _apply_devices(spec: DictConfig) -> None:
    """Fill each role's unset ``resources.gpu``: 1 GPU per instance when the job sets
    ``device_per_node`` (seed ``004``: ``device_per_node(4)`` with ``per_node(4)``
    gives each instance one device), else 0. Raises :class:`SpecError` for a
    negative ``node_num`` / ``device_per_node``."""
    for key in ("node_num", "device_per_node"):
        if spec[key] < 0:
            raise SpecError(key, spec[key], "an integer >= 0 (0: not set)")
    for r in spec.roles.values():
        if r.resources.gpu is None:
            r.resources.gpu = 1.0 if spec.device_per_node else 0.0


def _apply_template(spec: DictConfig, template: Any) -> None:
    names = ", ".join(r.name for r in template.roles)
    for rt in template.roles:
        if rt.required and rt.name not in spec.roles:
            raise SpecError(f"roles.{rt.name}", None, f"roles of template {template.name!r}: {names}",
                            f"template {template.name!r} requires role {rt.name!r}")
    known = {r.name for r in template.roles}
    for role in spec.roles:
        if known and role not in known:
            raise SpecError(f"roles.{role}", role, f"roles of template {template.name!r}: {names}")
    if not spec.edges:
        spec.edges = [list(e) for e in template.edges if e[0] in spec.roles and e[1] in spec.roles]
    if spec.driver is None and template.driver:
        spec.driver = template.driver
    if template.apply is not None:
        template.apply(spec)


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
        if r.total < 1:
            raise SpecError(f"{k}.total", r.total, "an integer >= 1")
        if r.per_node < 0:
            raise SpecError(f"{k}.per_node", r.per_node, "an integer >= 1 (or 0 for total)")
        per_node = r.per_node or r.total
        if r.total % per_node:
            raise SpecError(f"{k}.per_node", r.per_node,
                            f"a divisor of total={r.total} "
                            f"({', '.join(str(d) for d in range(1, r.total + 1) if r.total % d == 0)})",
                            f"total {r.total} is not divisible by per_node {r.per_node}")
        if spec.device_per_node and r.resources.gpu and per_node * r.resources.gpu > spec.device_per_node:
            raise SpecError(f"{k}.per_node", r.per_node,
                            f"at most device_per_node={spec.device_per_node} GPUs per node",
                            f"{per_node} instances x resources.gpu={r.resources.gpu:g} need "
                            f"{per_node * r.resources.gpu:g} GPUs on one node")
        if spec.node_num and r.total > spec.node_num * per_node:
            raise SpecError(f"{k}.total", r.total,
                            f"at most node_num x per_node = {spec.node_num} x {per_node} = "
                            f"{spec.node_num * per_node}")
        for res in ("cpu", "gpu"):
            v = r.resources[res]
            if v < 0:
                raise SpecError(f"{k}.resources.{res}", v, "a number >= 0")
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
    if spec.checkpoint.every_steps < 0:
        raise SpecError("checkpoint.every_steps", spec.checkpoint.every_steps, "an integer >= 0")
    if spec.checkpoint.keep < 1:
        raise SpecError("checkpoint.keep", spec.checkpoint.keep, "an integer >= 1")
    if spec.failover.max_restarts < 0:
        raise SpecError("failover.max_restarts", spec.failover.max_restarts, "an integer >= 0")
    if spec.failover.hang_timeout_s < 0:
        raise SpecError("failover.hang_timeout_s", spec.failover.hang_timeout_s, "seconds >= 0 (0 = off)")
    if spec.failover.pg_timeout_s <= 0:
        raise SpecError("failover.pg_timeout_s", spec.failover.pg_timeout_s, "seconds > 0")
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
