"""docs/hooks.md is generated from the hookspec docstrings and kept current."""

from __future__ import annotations

import inspect
import json
import os
import re

from dlrover_core.cli.hooks_doc import (
    DOC_PATH,
    collect_hooks,
    docstring_to_markdown,
    render_markdown,
)
from dlrover_core.cli.main import main
from dlrover_core.plugins import hookspecs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_docs_hooks_md_is_current():
    with open(os.path.join(ROOT, DOC_PATH)) as f:
        on_disk = f.read()
    assert on_disk == render_markdown(), (
        f"{DOC_PATH} is stale: the hookspecs changed. Regenerate it with "
        f"`.venv/bin/dlrover hooks --write {DOC_PATH}` and commit it")


def test_every_hookspec_is_documented():
    specs = {n for n in dir(hookspecs) if n.startswith("dlrover_")
             and hasattr(getattr(hookspecs, n), "dlrover_spec")}
    hooks = collect_hooks()
    assert {h.name for h in hooks} == specs
    classify = {h.name: h for h in hooks}["dlrover_classify_failure"]
    assert classify.firstresult and classify.process == "master"
    assert classify.phase == "failure classification"
    text = render_markdown(hooks)
    for name in specs:
        assert f"### {name}\n" in text


def test_stale_doc_is_detected():
    """A hookspec added to the source changes the generated text."""
    source = inspect.getsource(hookspecs) + '''

@hookspec
def dlrover_something_new(x: int) -> None:
    """A new hook. Worker process."""
'''
    hooks = collect_hooks(source)
    new = {h.name: h for h in hooks}["dlrover_something_new"]
    assert (new.args, new.process, new.firstresult) == ("x: int", "worker", False)
    assert render_markdown(hooks) != render_markdown()


def test_google_sections_and_examples():
    md = docstring_to_markdown("Do it. Master process.\n\nArgs:\n    job: the job name.\n"
                               "    metrics: name -> float,\n        per step.\n\nExample::\n\n"
                               "    @hookimpl\n    def f():\n        return 1\n")
    assert "- `job`: the job name." in md
    assert "- `metrics`: name -> float, per step." in md
    assert "```python\n@hookimpl\ndef f():\n    return 1\n```" in md


def _hookspecs() -> dict:
    """name -> hookspec function, found in the module by pluggy's marker (not by the
    code under test)."""
    return {n: getattr(hookspecs, n) for n in dir(hookspecs)
            if n.startswith("dlrover_") and hasattr(getattr(hookspecs, n), "dlrover_spec")}


def test_dlrover_hooks_prints_the_committed_doc(capsys, tmp_path):
    with open(os.path.join(ROOT, DOC_PATH)) as f:
        committed = f.read()
    assert main(["hooks"]) == 0
    printed = capsys.readouterr().out
    assert printed == committed, f"`dlrover hooks` differs from the committed {DOC_PATH}"
    specs = _hookspecs()
    assert len(specs) >= 10
    for name, fn in specs.items():
        first_line = inspect.getdoc(fn).splitlines()[0]
        section = printed.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
        assert first_line in section, (name, first_line)
        marker = "@hookspec(firstresult=True)" if fn.dlrover_spec["firstresult"] else "@hookspec\n"
        assert marker in section, name
    out = tmp_path / "hooks.md"
    assert main(["hooks", "--write", str(out)]) == 0
    assert out.read_text() == committed


def test_dlrover_hooks_json_lists_every_hookspec(capsys):
    assert main(["hooks", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    specs = _hookspecs()
    assert set(rows) == set(specs)
    for name, fn in specs.items():
        assert rows[name]["doc"] == inspect.getdoc(fn), name
        assert rows[name]["firstresult"] == fn.dlrover_spec["firstresult"], name
        written = re.findall(r"(?:^|, )(\w+)(?=:)", rows[name]["args"])
        assert written == list(inspect.signature(fn).parameters), name
