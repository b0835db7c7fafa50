"""Declaring a spec field's checks, and checking them: the one place for it.

The job spec is an OmegaConf structured config (:mod:`dlrover_core.spec.schema`):
OmegaConf merges a file and its overrides over the dataclasses and refuses a value it
cannot convert to a field's type. What a type cannot say (a range, a set of choices, a
rule between two fields) a field declares with :func:`spec_field`, in its dataclass,
and :func:`check_fields` checks it before anything starts. The plugins' own config
sections (``config.rl``, ``config.multimodal``, ``config.odl``) are frozen dataclasses
declared the same way; :func:`read_fields` converts a section's plain values to the
fields' types first (OmegaConf does that for the core spec). Every error is a
:class:`~dlrover_core.spec.errors.SpecError` naming the dotted key, the value and what
is allowed, e.g. ``config.rl.gamma: 1.5 is invalid; allowed: a number in (0, 1]``.

Example::

    @dataclass(frozen=True)
    class MyConfig:
        steps: int = spec_field(100, ge=1)                       # an integer >= 1
        timeout_s: float = spec_field(5.0, gt=0, unit="seconds")  # seconds > 0
        mode: str = spec_field("fast", choices=("fast", "exact"))

    cfg = MyConfig(**read_fields(MyConfig, section, "config.my"))
    check_fields(cfg, MyConfig, "config.my")
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.values import TYPE_WORDS, typed_value

#: the key of a field's :class:`Check` in its ``dataclasses.field`` metadata
CHECK = "dlrover_check"
_WORDS = {int: "an integer", float: "a number"}


@dataclasses.dataclass(frozen=True)
class Check:
    """What a field allows. Bounds (``ge`` >=, ``gt`` >, ``le`` <=, ``lt`` <) and
    ``choices`` are checked on the value; ``valid(value, section)`` is a rule that needs
    the other fields of the section. ``allowed`` is what an error says is allowed: a
    string, a function of the section, or ``None`` for the words :meth:`describe` makes
    from the bounds (``unit``: the noun instead of "an integer" / "a number", e.g.
    ``seconds``; ``note``: appended in parentheses)."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: Optional[tuple] = None
    valid: Optional[Callable[[Any, Any], bool]] = None
    allowed: Union[str, Callable[[Any], str], None] = None
    unit: Optional[str] = None
    note: Optional[str] = None

    def describe(self, kind: Any, section: Any = None) -> str:
        """What is allowed, as an error says it (``kind``: the field's type)."""
        if callable(self.allowed):  # words that name the other fields' values
            return self.allowed(section) if section is not None else TYPE_WORDS.get(kind, "")
        if self.allowed is not None:
            return self.allowed
        if self.choices is not None:
            words = ", ".join(str(c) for c in self.choices)
        else:
            words = self.unit or _WORDS.get(kind) or TYPE_WORDS.get(kind, "a value")
            low = (self.ge, "[") if self.ge is not None else (self.gt, "(")
            high = (self.le, "]") if self.le is not None else (self.lt, ")")
            if low[0] is not None and high[0] is not None:
                words += f" in {low[1]}{low[0]:g}, {high[0]:g}{high[1]}"
            elif low[0] is not None:
                words += f" {'>=' if self.ge is not None else '>'} {low[0]:g}"
            elif high[0] is not None:
                words += f" {'<=' if self.le is not None else '<'} {high[0]:g}"
        return f"{words} ({self.note})" if self.note else words

    def holds(self, value: Any, section: Any = None) -> bool:
        """Does ``value`` meet the bounds, the choices and the rule?"""
        if self.choices is not None and value not in self.choices:
            return False
        if self.ge is not None and not value >= self.ge:
            return False
        if self.gt is not None and not value > self.gt:
            return False
        if self.le is not None and not value <= self.le:
            return False
        if self.lt is not None and not value < self.lt:
            return False
        return self.valid is None or bool(self.valid(value, section))


def spec_field(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
               **check: Any) -> Any:
    """A dataclass field with ``default`` (or ``default_factory``) and a :class:`Check`
    built from ``check`` (``ge``, ``gt``, ``le``, ``lt``, ``choices``, ``valid``,
    ``allowed``, ``unit``, ``note``). OmegaConf's structured configs take it as a plain
    field.

    Raises:
        TypeError: an unknown check keyword (a bug in the declaring class).
    """
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={CHECK: Check(**check)})


@functools.lru_cache(maxsize=None)
def _declared(cls: type) -> tuple:
    """``(name, kind, nullable, check, nested dataclass or None)`` per field of ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, nullable = hints[f.name], False
        if typing.get_origin(kind) is Union or type(kind).__name__ == "UnionType":
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            nullable = len(args) < len(typing.get_args(kind))
            kind = args[0] if len(args) == 1 else Any
        nested = kind if dataclasses.is_dataclass(kind) else None
        out.append((f.name, kind, nullable, f.metadata.get(CHECK), nested))
    return tuple(out)


def _field(cls: type, name: str) -> tuple:
    return next(d for d in _declared(cls) if d[0] == name)


def _get(section: Any, name: str) -> Any:
    if isinstance(section, Mapping):
        return section.get(name)
    return getattr(section, name)


def check_value(cls: type, name: str, value: Any, key: str, section: Any = None) -> Any:
    """``value`` of field ``name`` of ``cls``, of the field's type (``typed_value``: an
    int may be a whole float, returned as int; ``None`` where the annotation is
    ``Optional``) and meeting its :class:`Check`; ``section`` holds the other fields,
    for a rule between fields. Returns the converted value.

    Raises:
        SpecError: keyed ``key``; allowed: the field's :meth:`Check.describe` (the type's
            words for a field without a check).
    """
    _, kind, nullable, check, _ = _field(cls, name)
    if value is None and nullable:
        return None
    given = value
    if kind in TYPE_WORDS:
        value = check_type(cls, name, value, key, section)
    if check is not None and not check.holds(value, section):
        raise SpecError(key, given, check.describe(kind, section))
    return value


def check_fields(section: Any, cls: type, key: str = "") -> None:
    """Check every declared field of ``cls`` in ``section`` (an instance, an OmegaConf
    node or a mapping of its fields; a field it lacks is skipped), in declaration order,
    and the fields of nested dataclass fields; ``key`` is the section's dotted key.

    Raises:
        SpecError: the first field that is not of its type or fails its check.
    """
    for name, _, _, check, nested in _declared(cls):
        if isinstance(section, Mapping) and name not in section:
            continue
        if not isinstance(section, Mapping) and not hasattr(section, name):
            continue
        value, k = _get(section, name), f"{key}.{name}" if key else name
        if nested is not None and value is not None:
            check_fields(value, nested, k)
        elif check is not None:
            check_value(cls, name, value, k, section)


def read_fields(cls: type, section: Mapping, key: str, names: Iterable[str] | None = None
                ) -> dict[str, Any]:
    """The values ``section`` (plain data, e.g. a plugin's config section) gives for the
    fields ``names`` of ``cls`` (default: all), converted to their types
    (:func:`check_type`; ranges are checked later by :func:`check_fields`, with the
    whole section). Keys of ``section`` outside ``names`` are left to the caller.

    Raises:
        SpecError: a value not of its field's type, keyed ``<key>.<field>``.
    """
    wanted = set(names) if names is not None else None
    out = {}
    for name, kind, nullable, _, _ in _declared(cls):
        if name in section and (wanted is None or name in wanted):
            value = section[name]
            if kind in TYPE_WORDS and not (value is None and nullable):
                value = check_type(cls, name, value, f"{key}.{name}")
            out[name] = value
    return out


def check_type(cls: type, name: str, value: Any, key: str, section: Any = None) -> Any:
    """``value`` converted to the type of field ``name`` of ``cls`` (``typed_value``);
    the error says what the field allows (its check's words, else the type's).

    Raises:
        SpecError: not of the type, keyed ``key``.
    """
    _, kind, _, check, _ = _field(cls, name)
    try:
        return typed_value(key, value, kind)
    except SpecError:
        allowed = check.describe(kind, section) if check else TYPE_WORDS[kind]
        raise SpecError(key, value, allowed) from None


def refuse_unknown(section: Mapping, known: Iterable[str], key: str, detail: str) -> None:
    """Refuse a key of ``section`` outside ``known``: ``SpecError(<key>.<k>, value,
    "one of: <known>", detail)``."""
    known = list(known)
    for k in section:
        if k not in known:
            raise SpecError(f"{key}.{k}", section[k], "one of: " + ", ".join(known), detail)


__all__ = ["CHECK", "Check", "check_fields", "check_type", "check_value", "read_fields",
           "refuse_unknown", "spec_field"]
