"""docs/hooks.md is generated from the hookspec docstrings and kept current."""

from __future__ import annotations

import json
import os

from dlrover_core.cli.hooks_doc import DOC_PATH, collect_hooks, docstring_to_markdown, render_markdown
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
    import inspect

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


def test_dlrover_hooks_prints_it(capsys, tmp_path):
    assert main(["hooks"]) == 0
    assert capsys.readouterr().out == render_markdown()
    assert main(["hooks", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} == {h.name for h in collect_hooks()}
    out = tmp_path / "hooks.md"
    assert main(["hooks", "--write", str(out)]) == 0
    assert out.read_text() == render_markdown()
