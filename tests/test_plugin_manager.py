"""The plugin manager lets pluggy do the work: blocking through ``set_blocked``,
failure classification through pluggy's ``firstresult`` call, one typed registry per
record kind. Plugins are real modules behind real entry points of fake distributions."""

from __future__ import annotations

import pytest

from dlrover_core import Backend, Failure, FailoverLevel, Tuner
from dlrover_core.plugins.manager import PluginManager, PluginStatus
from dlrover_core.plugins.registry import Registry, UnknownPluginError

CLASSIFIERS = """
from dlrover_core import FailureVerdict, hookimpl

@hookimpl(tryfirst=True)
def dlrover_classify_failure(failure, history):
    calls.append("{name}")
    if "{marker}" in failure.message:
        return FailureVerdict("{level}", "{name} knows it"{classifier})
    return None

calls = []
"""


@pytest.fixture(autouse=True)
def forget_fake_modules():
    """The fake plugin modules must not leak into other tests (same module names)."""
    import sys

    yield
    for name in [m for m in sys.modules if m.startswith("pm") and m.endswith("_fake_mod")]:
        del sys.modules[name]


def classifier(name: str, marker: str, level: str, classifier: str = "") -> str:
    return CLASSIFIERS.format(name=name, marker=marker, level=level,
                              classifier=f", classifier={classifier!r}" if classifier else "")


def test_blocked_names_are_blocked_in_pluggy(fake_dist):
    fake_dist("dlrover-plugin-pmzeta", "pmzeta", classifier("pmzeta", "ZETA", "role"))
    pm = PluginManager(env={"DLROVER_DISABLE_PLUGINS": "pmzeta"})
    assert pm.is_blocked("pmzeta") and pm._pm.is_blocked("pmzeta")
    import types

    info = pm.register(types.ModuleType("zeta_again"), "pmzeta")  # a late register is refused
    assert info.status is PluginStatus.BLOCKED and info.status == "blocked"
    assert "pmzeta" not in {pm._pm.get_name(p) for p in pm._pm.get_plugins()}
    v = pm.classify_failure(Failure("user_error", "t", 0, message="ZETA"))
    assert v.classifier == "builtin"


def test_classify_failure_is_pluggys_firstresult(fake_dist):
    fake_dist("dlrover-plugin-pmalpha", "pmalpha", classifier("pmalpha", "ALPHA", "node"))
    fake_dist("dlrover-plugin-pmbeta", "pmbeta", classifier("pmbeta", "BETA", "job", "beta-nccl"))
    pm = PluginManager()
    import pmalpha_fake_mod as alpha_fake_mod
    import pmbeta_fake_mod as beta_fake_mod

    v = pm.classify_failure(Failure("user_error", "t", 0, message="BETA"))
    assert (v.level, v.classifier) == (FailoverLevel.JOB, "beta-nccl")  # its own name kept
    v = pm.classify_failure(Failure("user_error", "t", 0, message="ALPHA"))
    assert (v.level, v.classifier) == ("node", "pmalpha")  # stamped with the plugin name
    alpha_fake_mod.calls.clear()
    beta_fake_mod.calls.clear()
    v = pm.classify_failure(Failure("user_error", "t", 0, message="BETA"))
    # the first answer ends the call: whichever of the two pluggy asks second is not
    # asked when the first one (beta) answers
    assert beta_fake_mod.calls == ["pmbeta"] and alpha_fake_mod.calls in ([], ["pmalpha"])
    v = pm.classify_failure(Failure("actor_died", "t", 0, message="SIGKILL"))
    assert (v.level, v.classifier) == ("process", "builtin")
    assert alpha_fake_mod.calls and beta_fake_mod.calls  # both declined before builtin


def test_one_typed_registry_per_record_kind(fake_dist):
    fake_dist("dlrover-plugin-pmrec", "pmrec", """
from dlrover_core import Backend, Tuner, hookimpl

@hookimpl
def dlrover_backends():
    return [Backend(name="recbe", session="m:S")]

@hookimpl
def dlrover_tuners():
    return [Tuner(name="rectuner", tuner="m:T")]
""")
    pm = PluginManager()
    assert isinstance(pm.backends, Registry) and pm.registry(Backend).kind is Backend
    be = pm.backends.get("recbe")
    assert isinstance(be, Backend) and be.provider == "pmrec"
    assert pm.registry(Tuner).get("rectuner").tuner == "m:T"
    assert "recbe" in pm.backends and "nope" not in pm.backends
    assert pm.backends() == pm.backends.all() and list(pm.backends) == pm.backends.names()
    assert pm.get_backend("recbe") is be  # the older spelling
    with pytest.raises(UnknownPluginError, match="unknown tuner 'nope'; installed: .*rectuner"):
        pm.tuners.get("nope")
    with pytest.raises(KeyError, match="is not a record kind; known: GraphTemplate"):
        pm.registry(int)
