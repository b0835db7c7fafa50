"""Command-line habits: options and overrides in any order, nothing cut off, --json."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from dlrover_core.cli.main import build_parser, main, parse_args
from dlrover_core.cli.output import print_table
from dlrover_core.cli.progress import JobProgress
from dlrover_core.plugins.manager import PluginManager, reset_plugin_manager

LONG_DIST = "dlrover-plugin-with-a-really-long-distribution-name"
LONG_PLUGIN = """
from dlrover_core import Backend, hookimpl

@hookimpl
def dlrover_backends():
    return [Backend(name="a-backend-with-a-long-name", session="x:Y")]
"""


@pytest.fixture
def long_plugin(fake_dist):
    fake_dist(LONG_DIST, "longname", LONG_PLUGIN, "9.8.7")
    reset_plugin_manager(PluginManager())
    yield
    reset_plugin_manager(None)


def test_options_and_overrides_in_any_order():
    parser = build_parser()
    args = parse_args(parser, ["submit", "job.yaml", "a=1", "--job-dir", "D", "lr=1e-3",
                               "--no-progress", "b.c=x"])
    assert args.job == "job.yaml"
    assert args.job_dir == "D"
    assert args.no_progress is True
    assert args.overrides == ["a=1", "lr=1e-3", "b.c=x"]
    args = parse_args(parser, ["submit", "--job-dir", "D", "job.yaml", "lr=2"])
    assert (args.job, args.job_dir, args.overrides) == ("job.yaml", "D", ["lr=2"])


def test_unknown_option_is_still_an_error(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(build_parser(), ["submit", "job.yaml", "lr=1", "--no-such-option"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command without overrides takes no key=value
        parse_args(build_parser(), ["stop", "job", "x=1"])


def test_validate_applies_overrides_given_after_an_option(capsys):
    rc = main(["validate", "examples/nanogpt/job.yaml", "config.max_steps=7",
               "roles.trainer.total=4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "max_steps: 7" in out
    assert "total: 4" in out


def test_plugins_list_piped_prints_whole_cells(long_plugin, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # room for every cell on one line
    assert main(["plugins", "list"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "longname" in ln)
    assert LONG_DIST in line and "backend:a-backend-with-a-long-name" in line
    assert "9.8.7" in line
    assert "…" not in out


def test_plugins_list_json(long_plugin, capsys):
    assert main(["plugins", "list", "--json"]) == 0
    infos = {i["name"]: i for i in json.loads(capsys.readouterr().out)}
    assert infos["longname"]["distribution"] == LONG_DIST
    assert infos["longname"]["provides"] == ["backend:a-backend-with-a-long-name"]
    assert infos["builtin"]["status"] == "active"


def test_templates_list_json(capsys):
    assert main(["templates", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list)
    for r in rows:
        assert set(r) == {"name", "provider", "description", "roles", "edges", "driver"}


def test_narrow_terminal_folds_instead_of_cutting():
    buf = io.StringIO()
    console = Console(file=buf, width=40, force_terminal=True, color_system=None)
    print_table(("name", "distribution"), [("deepspeed", LONG_DIST)], console=console)
    text = buf.getvalue()
    assert "…" not in text
    # the cell folded over several lines: glue the pieces of the second column back
    pieces = [ln.split("│")[2].strip() for ln in text.splitlines() if ln.count("│") == 3]
    assert "".join(pieces).endswith(LONG_DIST)


@pytest.mark.parametrize("width,terminal", [(4096, False), (44, True)])
def test_progress_shows_the_full_step_count(width, terminal):
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=terminal, color_system=None)
    with JobProgress(console=console) as bar:
        bar.update({"name": "nanogpt", "total_steps": 400, "step": 399, "state": "succeeded",
                    "metrics": {"loss": 1.234, "samples_per_s": 530.0},
                    "restarts": {"total": 2}})
    text = buf.getvalue()
    assert "400/400" in text
    assert "…" not in text
    flat = "".join(text.split())  # folded metrics: whitespace and line breaks removed
    assert "1.234" in flat and "530samples/s" in flat and "restarts2" in flat


def test_piped_output_of_the_real_command_is_whole():
    out = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "plugins", "list"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "dlrover-core" in out
    assert "…" not in out
    head = subprocess.run(f"{sys.executable} -m dlrover_core.cli.main plugins list --json"
                          " | head -c 10", shell=True, capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in head.stderr


def test_plugins_list_names_the_hooks_of_a_plugin_that_registers_nothing(capsys, monkeypatch):
    """Issue 52 item 7: megatron's and odl's failure classifiers show in the table, not
    only in --json (megatron's row had only its backend and engine)."""
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["plugins", "list"]) == 0
    rows = {ln.split("│")[1].strip(): ln for ln in capsys.readouterr().out.splitlines()
            if ln.count("│") > 3}
    assert "hook:classify_failure" in rows["megatron"], rows
    assert "hook:job_health" in rows["flashckpt"], rows
    assert "hook:" not in rows["sft"], rows  # registers its template, implements nothing else
