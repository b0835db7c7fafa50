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

from dlrover_core.spec.errors import SpecError, did_you_mean
from dlrover_core.spec.schema import DL_TYPES, JobSpec, RoleSpec
from dlrover_core.spec.validate import validate


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
        hint = ""
        if dataclasses.is_dataclass(node):
            names = [f.name for f in dataclasses.fields(node)]
            allowed = ", ".join(names)
            hint = did_you_mean(key.split(".")[-1], names)
        else:
            allowed = "a key of the job schema"
        return SpecError(key, key.split(".")[-1], f"one of: {allowed}",
                         f"unknown key in {source}" + (f"; {hint}" if hint else ""))
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
    spec = apply_overrides(spec, overrides, label, given=raw)

    _apply_script_roles(spec)
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


#: maps whose keys are free: environment variables, and options that their saver or
#: tuner checks itself (an unknown option is its error, with its own list)
_OPEN_MAPS = re.compile(r"^(env|roles\.[^.]+\.env|checkpoint\.options|tuning\.options)\.")


def _find_key(spec: DictConfig, key: str) -> tuple[bool, str, list[str], bool]:
    """Whether dotted ``key`` is in ``spec``; when not: the first missing part's parent
    key, the keys that parent has (for a "did you mean"), and whether that parent is a
    schema section (its keys are the schema's; OmegaConf's merge reports those)."""
    node: Any = spec
    parts = key.split(".")
    for i, part in enumerate(parts):
        parent = ".".join(parts[:i])
        if OmegaConf.is_dict(node):
            keys = [str(k) for k in node.keys()]
            if part not in keys:
                return False, parent, keys, dataclasses.is_dataclass(OmegaConf.get_type(node))
            node = node._get_node(part)
        elif OmegaConf.is_list(node):
            if not (part.isdigit() and int(part) < len(node)):
                return False, parent, [str(j) for j in range(len(node))], False
            node = node._get_node(int(part))
        else:  # below a value (``config.lr.x``): nothing to add to
            return False, parent, [], False
    return True, "", [], False


def apply_overrides(spec: DictConfig, overrides: Iterable[str],
                    source: str = "the job spec",
                    given: DictConfig | None = None) -> DictConfig:
    """Merge ``key=value`` overrides into ``spec``, in order, following Hydra's
    override grammar (https://hydra.cc/docs/advanced/override_grammar/basic/):

    - ``key=value`` changes a key that ``spec`` (the file merged over the schema) has;
      a key it does not have is an error with the nearest existing key
      (``config.max_step=60``: "did you mean 'max_steps'?"; a key the schema does not
      know, such as ``checkpoint.every_step``, likewise);
    - ``+key=value`` adds a key that is not there yet (an error if it is);
    - ``++key=value`` sets a key whether or not it is there.

    Exceptions: keys of ``env``, ``roles.<role>.env`` (environment variable names) and of
    ``checkpoint.options`` / ``tuning.options`` (checked by their saver or tuner) may be
    added without ``+``.

    Values are parsed as OmegaConf's dot-list parses them (YAML scalars, lists, dicts).
    ``given`` (the file as written, before the schema's defaults were merged in) lets the
    error of ``+key`` say whether the file has the key or the schema does.

    Raises:
        SpecError: an item without ``=``, an unknown key, ``+`` on an existing key, or a
            value of the wrong type (the message names the key, the value and what is
            allowed).
    """
    for item in overrides:
        if "=" not in item:
            raise SpecError("<override>", item, "key=value, +key=value (a new key) or "
                            "++key=value (OmegaConf dot-list, Hydra's override grammar)")
        key, _, value = item.partition("=")
        mode = "++" if key.startswith("++") else "+" if key.startswith("+") else ""
        key = key[len(mode):]
        found, parent, siblings, schema = _find_key(spec, key)
        if mode == "" and not found and not schema and not _OPEN_MAPS.match(key):
            missing = key[len(parent) + 1:].split(".")[0] if parent else key.split(".")[0]
            hint = did_you_mean(missing, siblings)
            where = f"{parent!r}" if parent else "the top level"
            raise SpecError(
                key, value, f"an existing key ({', '.join(siblings) or 'none'} at {where}), "
                f"or +{key}={value} to add it",
                f"{source} has no key {missing!r} at {where}" + (f"; {hint}" if hint else ""))
        if mode == "+" and found:
            if given is not None and not _find_key(given, key)[0]:
                default = OmegaConf.select(spec, key)
                why = (f"+{key} adds a key, but {key} is a key of every job spec (the "
                       f"schema's, default {default!r}), though {source} does not set it")
            else:
                why = f"+{key} adds a key, but {source} has it"
            raise SpecError(key, value, f"a new key; write {key}={value} to change it, or "
                            f"++{key}={value}", why)
        try:
            spec = OmegaConf.merge(spec, OmegaConf.from_dotlist([f"{key}={value}"]))
        except OmegaConfBaseException as exc:
            raise _convert(exc, "the overrides") from None
    return spec


def _apply_script_roles(spec: DictConfig) -> None:
    """Turn each role with a ``command`` into a script role: workload
    :class:`~dlrover_core.runtime.script.ScriptWorkload`, backend ``torchrun``, the
    command and working directory in the role's config. Checks, before anything starts,
    that the script file exists (relative to ``working_dir``), that a ``-m`` module can
    be found, and that a ``module:function`` entry imports and is callable (the module
    is imported here, in the client, with ``working_dir`` on ``sys.path``).

    Raises:
        SpecError: a role with both ``workload`` and ``command``, an empty or
            unparsable command, a missing file, module or function, a ``working_dir``
            that is not a directory, or a ``backend`` other than ``torchrun``.
    """
    import importlib
    import importlib.util
    import sys

    from dlrover_core.runtime.script import (
        CONFIG_KEY,
        SCRIPT_BACKEND,
        SCRIPT_WORKLOAD,
        parse_command,
    )

    for role, r in spec.roles.items():
        if r.get("command") is None:
            continue
        k = f"roles.{role}"
        if not OmegaConf.is_missing(r, "workload") and r.workload != SCRIPT_WORKLOAD:
            raise SpecError(f"{k}.workload", r.workload,
                            f"no workload in a script role ({k}.command is set)",
                            "a role runs either a BaseWorkload class or a command")
        allowed = ("a script and its arguments ('train.py --epochs 3'), '-m pkg.module "
                   "args' or 'pkg.module:function args'")
        try:
            cmd = parse_command(r.command)
        except ValueError as exc:
            raise SpecError(f"{k}.command", r.command, allowed, str(exc)) from None
        wd = os.path.abspath(r.working_dir or os.getcwd())
        if not os.path.isdir(wd):
            raise SpecError(f"{k}.working_dir", r.working_dir, "an existing directory")
        if cmd.kind == "script":
            path = os.path.join(wd, cmd.target)
            if not os.path.isfile(path):
                raise SpecError(f"{k}.command", r.command,
                                f"{allowed}, with a file that exists",
                                f"no file {cmd.target!r} in working_dir {wd}")
        else:
            module, _, function = cmd.target.partition(":")
            sys.path.insert(0, wd)
            try:
                found = importlib.util.find_spec(module)
                obj = None
                if found is not None and cmd.kind == "function":
                    obj = getattr(importlib.import_module(module), function, None)
            except Exception as exc:  # noqa: BLE001 - the user's module failed to import
                raise SpecError(f"{k}.command", r.command, f"{allowed}, importable",
                                f"importing {module!r} raised {type(exc).__name__}: "
                                f"{exc}") from None
            finally:
                sys.path.remove(wd)
            if found is None:
                raise SpecError(f"{k}.command", r.command, f"{allowed}, importable",
                                f"no module named {module!r} (working_dir {wd})")
            if cmd.kind == "function" and not callable(obj):
                raise SpecError(f"{k}.command", r.command, f"{allowed}, importable",
                                f"module {module!r} has no function {function!r}")
        if r.backend not in (None, SCRIPT_BACKEND):
            raise SpecError(f"{k}.backend", r.backend,
                            f"none or {SCRIPT_BACKEND!r} in a script role",
                            "the script sets up its own process group")
        r.backend = SCRIPT_BACKEND
        r.workload = SCRIPT_WORKLOAD
        r.working_dir = wd
        r.config[CONFIG_KEY] = {"command": r.command, "working_dir": wd}


def _apply_devices(spec: DictConfig) -> None:
    """Fill each role's unset ``resources.gpu``: 1 GPU per instance when the job sets
    ``device_per_node`` with ``device_type`` ``GPU`` (seed ``004``: ``device_per_node(4)``
    with ``per_node(4)`` gives each instance one device), else 0. Spread a role over
    ``node_num`` nodes when its ``per_node`` is unset, it is not elastic (``nodes``)
    and ``node_num`` divides its ``total``. Raises :class:`SpecError` for a negative ``node_num`` /
    ``device_per_node`` or a ``device_type`` other than ``CPU``/``GPU``."""
    for key in ("node_num", "device_per_node"):
        if spec[key] < 0:
            raise SpecError(key, spec[key], "an integer >= 0 (0: not set)")
    if not isinstance(spec.device_type, str) or spec.device_type.upper() not in ("CPU", "GPU"):
        raise SpecError("device_type", spec.device_type, "CPU or GPU")
    spec.device_type = spec.device_type.upper()
    gpu = spec.device_type == "GPU" and bool(spec.device_per_node)
    for r in spec.roles.values():
        if r.resources.gpu is None:
            r.resources.gpu = 1.0 if gpu else 0.0
        if spec.node_num > 1 and not r.per_node and r.nodes is None \
                and r.total % spec.node_num == 0:
            r.per_node = r.total // spec.node_num


def _apply_template(spec: DictConfig, template: Any) -> None:
    names = ", ".join(r.name for r in template.roles)
    for rt in template.roles:
        if rt.required and not rt.pattern and rt.name not in spec.roles:
            raise SpecError(f"roles.{rt.name}", None,
                            f"roles of template {template.name!r}: {names}",
                            f"template {template.name!r} requires role {rt.name!r}")
    known = {r.name for r in template.roles}
    open_names = any(r.pattern for r in template.roles)  # apply() checks those names
    for role in spec.roles:
        if known and not open_names and role not in known:
            raise SpecError(f"roles.{role}", role, f"roles of template {template.name!r}: {names}")
    if not spec.edges:
        spec.edges = [list(e) for e in template.edges if e[0] in spec.roles and e[1] in spec.roles]
    if spec.driver is None and template.driver:
        spec.driver = template.driver
    if template.apply is not None:
        template.apply(spec)
