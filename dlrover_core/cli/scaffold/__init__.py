"""``dlrover plugin new NAME --kind KIND``: write a plugin package that installs and
passes its own tests as generated.

The package (``dlrover-plugin-NAME/``): ``pyproject.toml`` with the ``dlrover.plugins``
entry point ``NAME = "dlrover_plugin_NAME.plugin"``, the plugin module, an
implementation skeleton that works, tests using :mod:`dlrover_core.testing`, and a
README. The kinds are in :mod:`dlrover_core.cli.scaffold.kinds`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from dlrover_core import __version__
from dlrover_core.cli.scaffold import common
from dlrover_core.cli.scaffold.kinds import KINDS, Kind

_NAME_RE = re.compile(r"^[a-z][a-z0-9_\-]*[a-z0-9]$|^[a-z]$")


class ScaffoldError(ValueError):
    """Bad input to ``dlrover plugin new`` (the message names it and what is allowed)."""


def core_requirement(version: str = __version__) -> str:
    """``dlrover-core>=MAJOR.MINOR,<MAJOR.MINOR+1`` for a 0.x core (a minor release may
    change hooks), ``>=MAJOR.MINOR,<MAJOR+1`` from 1.0 on."""
    major, minor = (int(p) for p in version.split(".")[:2])
    upper = f"{major}.{minor + 1}" if major == 0 else f"{major + 1}"
    return f"dlrover-core>={major}.{minor},<{upper}"


def placeholders(name: str, kind: Kind) -> dict[str, str]:
    """The values of the placeholders of :mod:`.common` and :mod:`.kinds` for ``name``."""
    ident = name.replace("-", "_")
    provides = [p.replace("__NAME__", name) for p in kind.provides]
    layout = "".join(f"| `{path}` | {what} |\n" for path, what in kind.layout)
    return {
        "__DIST__": f"dlrover-plugin-{name}",
        "__PKG__": f"dlrover_plugin_{ident}",
        "__CLASS__": "".join(p.capitalize() for p in re.split(r"[-_]", name) if p),
        "__NAME_ID__": ident,
        "__CORE_REQ__": core_requirement(),
        "__KIND__": kind.name,
        "__DEPS__": "".join(f', "{d}"' for d in kind.deps),
        "__SUMMARY__": kind.summary,
        "__PROVIDES__": ", ".join(provides) or "nothing listed (it implements a hook)",
        "__PROVIDES_LIST__": json.dumps(provides),
        "__HOOKS__": ", ".join(kind.hooks),
        "__HOOKS_LIST__": json.dumps(list(kind.hooks)),
        "__LAYOUT__": layout,
        "__USAGE__": kind.usage,
        "__NAME__": name,  # last: the other placeholders' values may contain it
    }


def render(text: str, values: dict[str, str]) -> str:
    """Replace every placeholder of ``values`` in ``text``, in the dict's order; a second
    pass resolves placeholders inside the values (the layout rows, the usage)."""
    for _ in range(2):
        for key, value in values.items():
            text = text.replace(key, value)
    return text


def check_name(name: str) -> None:
    """Raise :class:`ScaffoldError` unless ``name`` can be a plugin name."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ScaffoldError(
            f"plugin name {name!r} is invalid; allowed: lower-case letters, digits, '_' or "
            "'-', starting with a letter and not ending with '-' or '_' (e.g. 'mybackend')")


def new_plugin(name: str, kind: str, dest: str | os.PathLike = ".",
               force: bool = False) -> Path:
    """Write the package of plugin ``name`` of ``kind`` into ``dest/dlrover-plugin-NAME``.

    Returns:
        the package directory.
    Raises:
        ScaffoldError: ``name`` or ``kind`` is invalid, or the directory exists and is
            not empty (without ``force``); nothing is written then.
    """
    check_name(name)
    if kind not in KINDS:
        raise ScaffoldError(f"--kind {kind!r} is unknown; allowed: {', '.join(KINDS)}")
    spec = KINDS[kind]
    values = placeholders(name, spec)
    root = Path(dest) / values["__DIST__"]
    if root.exists() and any(root.iterdir()) and not force:
        raise ScaffoldError(f"{root} exists and is not empty; choose another --dir or "
                            "pass --force to overwrite the generated files")
    files = {"pyproject.toml": common.PYPROJECT, "README.md": common.README,
             "__PKG__/__init__.py": common.INIT, "tests/__init__.py": "",
             "tests/conftest.py": common.CONFTEST, "tests/test_listed.py": common.TEST_LISTED,
             **spec.files}
    for rel, text in files.items():
        path = root / render(rel, values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(text, values))
    return root
