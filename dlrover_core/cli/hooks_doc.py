"""``docs/hooks.md``, generated from the hookspec docstrings; ``dlrover hooks`` prints it.

The hooks are read from the source of :mod:`dlrover_core.plugins.hookspecs` with
:mod:`ast` (so signatures read as written, in source order, grouped by the module's
``# ---- <phase>`` comments). Docstrings are Google style: ``Args:``/``Returns:``/
``Raises:`` sections become bullet lists and a paragraph ending in ``::`` introduces a
Python code block.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
from dataclasses import dataclass

from dlrover_core.cli.output import print_json

DOC_PATH = "docs/hooks.md"
_SECTION_RE = re.compile(r"^# -{10,}\s*(.+?)\s*$")
_GOOGLE_SECTIONS = ("Args:", "Returns:", "Raises:", "Yields:", "Attributes:")


@dataclass(frozen=True)
class HookDoc:
    """One hookspec as documented: ``name``, ``args`` and ``returns`` as written in the
    source, its ``phase`` (the section comment above it), the ``process`` it runs in,
    ``firstresult``, and the docstring."""

    name: str
    args: str
    returns: str
    phase: str
    process: str
    firstresult: bool
    doc: str

    @property
    def signature(self) -> str:
        return f"{self.name}({self.args}) -> {self.returns}"

    @property
    def summary(self) -> str:
        """The docstring's first sentence."""
        first = " ".join(self.doc.split("\n\n")[0].split())
        m = re.match(r"(.+?\.)(\s|$)", first)
        return m.group(1) if m else first

    def as_dict(self) -> dict:
        return {"name": self.name, "args": self.args, "returns": self.returns,
                "phase": self.phase, "process": self.process,
                "firstresult": self.firstresult, "doc": self.doc}


def _process(doc: str) -> str:
    text = " ".join(doc.split())
    for pattern, process in ((r"\bmaster process\b", "master"), (r"\bworker process\b", "worker"),
                             (r"\bclient process\b", "client"),
                             (r"once per process", "any (on load)")):
        if re.search(pattern, text, re.I):
            return process
    return "-"


def _is_hookspec(dec: ast.expr) -> tuple[bool, bool]:
    """(is a ``@hookspec`` decorator, has ``firstresult=True``)."""
    target = dec.func if isinstance(dec, ast.Call) else dec
    if not (isinstance(target, ast.Name) and target.id == "hookspec"):
        return False, False
    first = isinstance(dec, ast.Call) and any(
        k.arg == "firstresult" and isinstance(k.value, ast.Constant) and k.value.value
        for k in dec.keywords)
    return True, first


def collect_hooks(source: str | None = None) -> list[HookDoc]:
    """Every hookspec of ``source`` (default: the installed ``hookspecs`` module), in
    source order."""
    if source is None:
        from dlrover_core.plugins import hookspecs

        source = inspect.getsource(hookspecs)
    lines = source.splitlines()
    sections = [(i + 1, m.group(1)) for i, ln in enumerate(lines)
                if (m := _SECTION_RE.match(ln))]
    out = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        marks = [_is_hookspec(d) for d in node.decorator_list]
        if not any(m for m, _ in marks):
            continue
        phase = ""
        for lineno, name in sections:
            if lineno < node.lineno:
                phase = name
        doc = ast.get_docstring(node) or ""
        out.append(HookDoc(node.name, ast.unparse(node.args),
                           ast.unparse(node.returns) if node.returns else "None", phase,
                           _process(doc), any(f for _, f in marks), doc))
    return out


def docstring_to_markdown(doc: str) -> str:
    """Google-style sections -> bullet lists; ``::`` paragraphs -> code blocks."""
    out: list[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped in _GOOGLE_SECTIONS:
            out.append(f"**{stripped[:-1]}**")
            out.append("")
            i += 1
            items: list[str] = []
            while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
                text = lines[i].strip()
                if not text:
                    if i + 1 < len(lines) and not lines[i + 1].startswith(" "):
                        break
                elif len(lines[i]) - len(lines[i].lstrip()) <= 4:
                    m = re.match(r"([\w, *]+?):\s*(.*)", text)
                    items.append(f"- `{m.group(1)}`: {m.group(2)}" if m else f"- {text}")
                else:
                    items[-1:] = [(items[-1] if items else "-") + " " + text]
                i += 1
            out.extend(items)
            out.append("")
            continue
        if stripped.endswith("::"):
            out.append(line.rstrip()[:-1])  # "Example::" -> "Example:"
            out.append("")
            i += 1
            block: list[str] = []
            while i < len(lines) and (lines[i].startswith(" ") or not lines[i].strip()):
                block.append(lines[i][4:] if lines[i].startswith("    ") else lines[i].strip())
                i += 1
            while block and not block[0].strip():
                block.pop(0)
            while block and not block[-1].strip():
                block.pop()
            out += ["```python", *block, "```", ""]
            continue
        out.append(line)
        i += 1
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out)


def render_markdown(hooks: list[HookDoc] | None = None) -> str:
    """The full text of ``docs/hooks.md``."""
    from dlrover_core.plugins import hookspecs
    from dlrover_core.plugins.records import FAILOVER_LEVELS

    hooks = collect_hooks() if hooks is None else hooks
    intro = docstring_to_markdown(inspect.getdoc(hookspecs) or "")
    parts = [
        "# Hook reference",
        "",
        "<!-- generated from dlrover_core/plugins/hookspecs.py by "
        "`dlrover hooks --write docs/hooks.md`; do not edit by hand -->",
        "",
        intro,
        "",
        f"Failover levels, smallest first: {', '.join(f'`{x}`' for x in FAILOVER_LEVELS)}.",
        "",
        "| hook | phase | process | returns | what |",
        "|---|---|---|---|---|",
    ]
    for h in hooks:
        ret = h.returns.replace("|", "\\|") + ("` (firstresult)" if h.firstresult else "`")
        parts.append(f"| [`{h.name}`](#{h.name}) | {h.phase} | {h.process} | `{ret} | "
                     f"{h.summary.replace('|', '/')} |")
    phase = None
    for h in hooks:
        if h.phase != phase:
            phase = h.phase
            parts += ["", f"## {phase.capitalize() or 'Hooks'}"]
        parts += ["", f"### {h.name}", "", "```python",
                  ("@hookspec(firstresult=True)" if h.firstresult else "@hookspec"),
                  f"def {h.signature}", "```", "", docstring_to_markdown(h.doc)]
    return "\n".join(parts).rstrip() + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hooks", help="the hook reference (docs/hooks.md), from the hookspecs")
    p.add_argument("--json", action="store_true", help="the hooks as a JSON list")
    p.add_argument("--write", metavar="FILE", default=None,
                   help=f"write the markdown to FILE (e.g. {DOC_PATH}) instead of printing it")
    p.set_defaults(func=cmd_hooks)


def cmd_hooks(args: argparse.Namespace) -> int:
    if args.json:
        print_json([h.as_dict() for h in collect_hooks()])
        return 0
    text = render_markdown()
    if args.write:
        from dlrover_core.atomic_io import atomic_write_text

        atomic_write_text(args.write, text)
        print(f"wrote {args.write}")
        return 0
    import sys

    sys.stdout.write(text)
    return 0
