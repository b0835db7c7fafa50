"""The ``classifier`` kind of ``dlrover plugin new``: its files and what it provides."""

from __future__ import annotations

from dlrover_core.cli.scaffold.kinds.base import Kind

_CLASSIFIER_PLUGIN = '''\
"""Entry point of the ``__NAME__`` plugin: a failure classifier.

``dlrover_classify_failure`` is ``firstresult``: this plugin answers for the errors it
recognises and returns ``None`` for the others, which the built-in classifier (called
last) then decides.
"""

from __future__ import annotations

import re

from dlrover_core import Failure, FailureVerdict, hookimpl

#: (pattern searched in "exc_type: message", failover level, reason)
RULES: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"out of memory", re.I), "fatal",
     "the device ran out of memory; lower the micro-batch size or shard the model"),
    (re.compile(r"NCCL.*(timeout|timed out)|Watchdog caught collective", re.I), "process",
     "a collective timed out; restart the ranks of the group from the checkpoint"),
]


@hookimpl
def dlrover_classify_failure(failure: Failure, history: list[Failure]) -> FailureVerdict | None:
    text = f"{failure.exc_type}: {failure.message}"
    for pattern, level, reason in RULES:
        if pattern.search(text):
            return FailureVerdict(level=level, reason=reason)
    return None
'''

_CLASSIFIER_TEST = '''\
"""The ``__NAME__`` classifier answers for its errors, the built-in one for the rest.

The manager here holds the built-in plugin and this one only: other installed
classifiers may answer the same errors first (``firstresult``), which
``test_installed_...`` shows.
"""

from __future__ import annotations

import pytest

from dlrover_core import Failure
from dlrover_core.plugins.manager import PluginManager

import __PKG__.plugin as plugin

OOM = Failure(kind="user_error", role="trainer", rank=1, exc_type="torch.OutOfMemoryError",
              message="CUDA out of memory. Tried to allocate 2.00 GiB")
TIMEOUT = Failure(kind="user_error", role="trainer", rank=0,
                  exc_type="torch.distributed.DistBackendError",
                  message="[Rank 0] Watchdog caught collective operation timeout")


@pytest.fixture
def pm():
    manager = PluginManager(load_entry_points=False)
    manager.register(plugin, "__NAME__")
    return manager


@pytest.mark.parametrize("failure,level", [(OOM, "fatal"), (TIMEOUT, "process")])
def test_recognised_errors(pm, failure, level):
    verdict = pm.classify_failure(failure)
    assert (verdict.level, verdict.classifier) == (level, "__NAME__")


def test_other_errors_go_to_the_builtin(pm):
    verdict = pm.classify_failure(Failure(kind="actor_died", role="trainer", rank=0,
                                          message="the actor died unexpectedly"))
    assert verdict.classifier == "builtin"


def test_installed_through_its_entry_point(plugin_manager):
    info = {i.name: i for i in plugin_manager.plugins()}["__NAME__"]
    assert info.status == "active", info.error
    assert "dlrover_classify_failure" in info.hooks
'''

CLASSIFIER = Kind(
    name="classifier", summary="A failure classifier: errors it knows -> failover level",
    provides=(), hooks=("dlrover_classify_failure",),
    files={"__PKG__/plugin.py": _CLASSIFIER_PLUGIN, "tests/test___NAME__.py": _CLASSIFIER_TEST},
    usage="Installed, it is asked first about every failure of every job; the level it "
          "answers (`process`, `role`, `node`, `job`, `fatal`) is in `events.jsonl` "
          "(`failure_classified`, `classifier: __NAME__`).\n")
