"""A JSON Schema of the job spec, generated from the spec's dataclasses (``dlrover schema``).

An editor with yaml-language-server (VS Code's YAML extension, Neovim, Helix...)
completes and checks ``job.yaml`` against it once the file names it in a modeline::

    # yaml-language-server: $schema=./dlrover-job.schema.json

The schema is derived from :class:`dlrover_core.spec.schema.JobSpec` and the classes it
holds, so it cannot drift from what :func:`dlrover_core.spec.loader.load_spec` merges
over: each dataclass is an object that admits only its fields (as the loader refuses an
unknown key), a field whose default is OmegaConf's ``MISSING`` is required (but a role's
``workload``, which a template or a ``command`` fills in), types map as
``int`` -> integer, ``float`` -> number, ``bool`` -> boolean, ``str`` -> string,
``Optional[X]`` -> X or null, ``Dict[str, X]`` -> an object of X, ``List[X]`` -> an array
of X, ``Any`` -> anything. With ``registered`` (the plugin manager's names), the fields
that name a registered thing (``template``, ``placement``, ``checkpoint.saver``,
``roles.<role>.backend``, ``tuning.tuners``) list the names installed here as ``enum``.

What a schema cannot say, the loader still checks (role names of a template, script
roles' files, value ranges, elastic sizes): ``dlrover validate`` remains the full check.
Draft 2020-12 (https://json-schema.org/draft/2020-12/schema).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from omegaconf import MISSING

from dlrover_core.spec.schema import JobSpec

DRAFT = "https://json-schema.org/draft/2020-12/schema"
# MISSING fields a file may still leave out: a role's workload comes from its template or
# from its ``command`` (a script role)
_FILLED_LATER = {("RoleSpec", "workload")}
_SCALARS = {int: "integer", float: "number", bool: "boolean", str: "string"}


def _type_schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of one annotation ``tp``."""
    if tp is Any or tp is object:
        return {}
    if dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # a placeholder against recursion
            defs[name] = _class_schema(tp, defs)
        return {"$ref": f"#/$defs/{name}"}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        alts = [_type_schema(a, defs) for a in inner]
        if type(None) in args:
            alts.append({"type": "null"})
        return alts[0] if len(alts) == 1 else {"anyOf": alts}
    if origin in (dict, typing.Dict):
        value = args[1] if len(args) == 2 else Any
        return {"type": "object", "additionalProperties": _type_schema(value, defs)}
    if origin in (list, typing.List):
        item = args[0] if args else Any
        return {"type": "array", "items": _type_schema(item, defs)}
    raise TypeError(f"no JSON Schema for the spec annotation {tp!r}")


def _default(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return value


def _class_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required = []
    for f in dataclasses.fields(cls):
        s = dict(_type_schema(hints[f.name], defs))
        if f.default is MISSING:
            if (cls.__name__, f.name) not in _FILLED_LATER:
                required.append(f.name)
        elif f.default is not dataclasses.MISSING:
            s["default"] = _default(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            s["default"] = _default(f.default_factory())  # type: ignore[misc]
        props[f.name] = s
    out: dict[str, Any] = {"type": "object", "properties": props,
                           "additionalProperties": False}
    doc = inspect.getdoc(cls)
    if doc:
        out["description"] = doc
    if required:
        out["required"] = required
    return out


def _with_enum(s: dict[str, Any], names: list[str]) -> None:
    """Put ``enum`` on ``s`` (or on its non-null alternative)."""
    if "anyOf" in s:
        for alt in s["anyOf"]:
            if alt.get("type") == "string":
                alt["enum"] = names
    else:
        s["enum"] = names


def job_spec_schema(registered: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a job spec file, as a dict.

    Args:
        registered: the names installed here, by kind: ``templates``, ``placements``,
            ``savers``, ``backends``, ``tuners`` (any may be absent); each becomes the
            ``enum`` of the fields that name one.
    Raises:
        TypeError: a spec field whose annotation has no JSON Schema form (a bug in the
            spec classes).
    """
    defs: dict[str, Any] = {}
    top = _class_schema(JobSpec, defs)
    reg = registered or {}
    if reg.get("templates"):
        _with_enum(top["properties"]["template"], sorted(reg["templates"]))
    if reg.get("placements"):
        _with_enum(top["properties"]["placement"], sorted(reg["placements"]))
    if reg.get("savers"):
        _with_enum(defs["CheckpointSpec"]["properties"]["saver"], sorted(reg["savers"]))
    if reg.get("backends"):
        _with_enum(defs["RoleSpec"]["properties"]["backend"], sorted(reg["backends"]))
    if reg.get("tuners"):
        defs["TuningSpec"]["properties"]["tuners"]["items"]["enum"] = sorted(reg["tuners"])
    return {"$schema": DRAFT, "title": "dlrover-core job spec", **top, "$defs": defs}


def registered_names(pm: Any) -> dict[str, list[str]]:
    """The names of the plugin manager ``pm``'s registries, for :func:`job_spec_schema`."""
    return {"templates": pm.templates.names(), "placements": pm.placement_policies.names(),
            "savers": pm.savers.names(), "backends": pm.backends.names(),
            "tuners": pm.tuners.names()}
