"""The README holds: its links stay inside the repository, its Python snippets run as
written, a builder job checkpoints by default (issue 29, item 8)."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _text(path: str = README) -> str:
    with open(path) as f:
        return f.read()


def _snippet(after: str) -> str:
    """The first ```python block of the README after the line containing ``after``."""
    text = _text()
    start = text.index(after)
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, f"no python block after {after!r}"
    return m.group(1)


@pytest.mark.parametrize("page", ["README.md", "docs/README.md", "docs/architecture.md"])
def test_links_stay_in_the_repository(page):
    text = _text(os.path.join(ROOT, page))
    assert "../shared" not in text and "DESIGN.md" not in text
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        assert not target.startswith(("http://", "https://", "/")), target
        path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
        assert path.startswith(ROOT + os.sep) and os.path.exists(path), (page, target)


def test_docs_index_lists_every_page():
    index = _text(os.path.join(ROOT, "docs", "README.md"))
    for name in os.listdir(os.path.join(ROOT, "docs")):
        if name.endswith(".md") and name != "README.md":
            assert f"]({name})" in index, name


def test_builder_job_checkpoints_by_default():
    from dlrover_core import DLJobBuilder

    def job(**ck):
        b = (DLJobBuilder().name("x").workload("trainer", "tests.workloads", "Echo")
             .total(1))
        return (b.checkpoint(**ck) if ck else b).build()

    assert job().spec.checkpoint.every_steps == 100
    assert job(every_steps=7).spec.checkpoint.every_steps == 7
    assert job(keep=1).spec.checkpoint.every_steps == 100


def test_load_spec_snippet_runs(capsys):
    code = _snippet("becomes the same kind of spec in Python with `load_spec`")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(code, "README.md", "exec"), {})
    finally:
        os.chdir(cwd)
    assert capsys.readouterr().out.split() == ["fsdp", "100"]


@pytest.mark.slow  # a whole job from the README: ~10 s
def test_python_api_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    """Runs the README's builder job (20 tiny steps, 2 FSDP2 ranks on a local Ray
    cluster) from a directory of its own, with the repository on PYTHONPATH."""
    code = _snippet("The same job in Python")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    monkeypatch.syspath_prepend(ROOT)
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.split()[-2:] == ["succeeded", "20"]
    assert (tmp_path / "runs" / "nanogpt-py" / "summary.json").exists()
