"""Tables fit the width (terminal, or $COLUMNS / PIPE_WIDTH when piped), fold at spaces,
leave out columns empty in every row; restart counts print in one order (issue 29, item 9).
No Ray is started here."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

from rich.console import Console

from dlrover_core.cli.output import PIPE_WIDTH, fit_widths, format_restarts, print_table
from dlrover_core.cli.progress import print_summary
from dlrover_core.master.failover import FailoverCoordinator

WORDS = "encoders -> fusion trainer: roles 'trainer' (required) and one encoder role per " \
        "modality, frozen or trainable; embeddings move to the trainer as references"


def _cells(text: str, col: int) -> list[str]:
    """The ``col``-th cell of every body line of a rich table."""
    return [ln.split("│")[col + 1].strip() for ln in text.splitlines() if ln.count("│") >= 3]


def _render(width: int, rows, columns=("name", "driver", "description", "error")) -> str:
    buf = io.StringIO()
    print_table(columns, rows, console=Console(file=buf, width=width, color_system=None))
    return buf.getvalue()


def test_a_wide_table_fits_and_folds_at_spaces():
    text = _render(70, [("multimodal", "dlrover_plugin_multimodal.driver:Driver", WORDS, "")])
    assert max(len(ln) for ln in text.splitlines()) <= 70
    pieces = [p for p in _cells(text, 2) if p]
    assert len(pieces) > 1  # folded
    assert " ".join(pieces) == WORDS  # at spaces: every piece ends and starts a word
    assert "".join(_cells(text, 0)) == "multimodal"  # a short word is never split
    assert "…" not in text


def test_an_always_empty_column_is_left_out_and_a_used_one_kept():
    text = _render(200, [("a", "x:Y", "short", ""), ("b", "x:Z", "short", None)])
    assert "error" not in text and "name" in text
    text = _render(200, [("a", "x:Y", "short", ""), ("b", "x:Z", "short", "boom")])
    assert "error" in text and "boom" in text


def test_a_narrow_table_is_as_wide_as_its_content():
    text = _render(200, [("a", "b", "c", "d")])
    assert max(len(ln) for ln in text.splitlines()) < 60


def test_fit_widths_gives_every_column_its_longest_word_first():
    assert fit_widths([3, 5], [10, 20], 100) == [10, 20]
    w = fit_widths([10, 4, 8], [10, 40, 80], 60)
    assert sum(w) == 60 and w[0] == 10 and w[1] >= 4 and w[2] >= 8
    assert sum(fit_widths([30, 30], [30, 30], 40)) == 40  # words longer than the room fold


def test_piped_templates_list_fits_columns():
    env = {**os.environ, "COLUMNS": "90"}
    out = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "templates", "list"],
                         capture_output=True, text=True, timeout=120, check=True, env=env).stdout
    assert "multimodal" in out
    assert max(len(ln) for ln in out.splitlines()) <= 90
    assert "\x1b[" not in out  # no colour codes in a pipe
    env.pop("COLUMNS")
    out = subprocess.run([sys.executable, "-m", "dlrover_core.cli.main", "templates", "list"],
                         capture_output=True, text=True, timeout=120, check=True, env=env).stdout
    assert max(len(ln) for ln in out.splitlines()) <= PIPE_WIDTH


def test_restart_counts_print_in_one_order():
    assert format_restarts({"total": 3, "node": 1, "process": 2}) == "3 (process 2, node 1)"
    assert format_restarts({"node": 1, "total": 3, "process": 2}) == "3 (process 2, node 1)"
    assert format_restarts({"total": 0}) == "0" and format_restarts(None) == "0"
    policy = FailoverCoordinator.__new__(FailoverCoordinator)
    policy.counts = {"job": 1, "node": 2, "process": 1}
    assert list(policy.restart_counts()) == ["total", "process", "node", "job"]
    buf = io.StringIO()
    print_summary({"name": "j", "status": "succeeded", "steps": 5, "wall_s": 1.0,
                   "restarts": {"total": 3, "node": 1, "process": 2}},
                  console=Console(file=buf, width=100, color_system=None))
    assert re.search(r"restarts\s+│ 3 \(process 2, node 1\)", buf.getvalue())
    # a job's error text is printed as it is, never read as markup (a gloo message)
    err = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
           "pair.cc:553] Connection closed by peer [bold]")
    buf = io.StringIO()
    print_summary({"name": "j", "status": "failed", "steps": 0, "wall_s": 1.0, "error": err},
                  console=Console(file=buf, width=400, color_system=None))
    assert "error: " + err in buf.getvalue()
