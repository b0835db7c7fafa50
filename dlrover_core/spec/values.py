"""Reading a template's own config section (``config.rl``, ``config.multimodal``, ...):
values converted to the type of a setting's default, with a :class:`SpecError` naming
the key, the value and what is allowed. Shared by the template plugins."""

from __future__ import annotations

from typing import Any

from dlrover_core.spec.errors import SpecError

#: what each setting type allows, as errors say it
TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def plain(value: Any) -> Any:
    """``value`` as plain dicts and lists when it is an OmegaConf container (resolved),
    else unchanged."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    return value


def typed_value(key: str, value: Any, kind: type) -> Any:
    """``value`` as a ``kind`` (``bool``, ``int``, ``float`` or ``str``): a bool must be
    a bool; an int an int or a whole float (``2.0`` -> 2), never a bool; a float any
    number but a bool (returned as float); a str a str. Another ``kind``: ``value``
    unchanged.

    Raises:
        SpecError: ``value`` is not of ``kind``; names ``key`` and ``value``.
    """
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise SpecError(key, value, TYPE_WORDS[bool])
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise SpecError(key, value, TYPE_WORDS[int])
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(key, value, TYPE_WORDS[float])
        return float(value)
    if kind is str and not isinstance(value, str):
        raise SpecError(key, value, TYPE_WORDS[str])
    return value
