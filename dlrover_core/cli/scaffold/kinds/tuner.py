"""The ``tuner`` kind of ``dlrover plugin new``: its files and what it provides."""

from __future__ import annotations

from dlrover_core.cli.scaffold.kinds.base import Kind

_TUNER_PLUGIN = '''\
\"\"\"Entry point of the ``__NAME__`` plugin: the ``__NAME__`` tuner.\"\"\"

from __future__ import annotations

from dlrover_core import Tuner, hookimpl


@hookimpl
def dlrover_tuners() -> list[Tuner]:
    return [Tuner(name="__NAME__", tuner="__PKG__.tuner:__CLASS__Tuner",
                  description="activation checkpointing on when memory runs short")]
'''

_TUNER_IMPL = '''\
\"\"\"The ``__NAME__`` tuner: switch FSDP2 activation checkpointing on when the memory
peak of the last window is above ``memory_share`` of the device's capacity; once the
guard reverted that, never propose it again in this job.

Runs in the master (and its option check in the client): imports nothing heavy.
\"\"\"

from __future__ import annotations

from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.tuner import TunerBase, WindowSummary


class __CLASS__Tuner(TunerBase):
    defaults = {"memory_share": 0.9}

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.gave_up = False

    @classmethod
    def validate_options(cls, options: dict) -> None:
        super().validate_options(options)
        share = options.get("memory_share", cls.defaults["memory_share"])
        if not 0.0 < share <= 1.0:
            raise ValueError(f"memory_share: {share!r} is invalid; allowed: a number in (0, 1]")

    def propose(self, window: WindowSummary, current: TuningConfig) -> dict | None:
        if self.gave_up or current.parallelism.activation_checkpointing:
            return None
        if window.memory_capacity_bytes <= 0:  # capacity unknown: nothing to compare with
            return None
        if window.memory_bytes > self.options["memory_share"] * window.memory_capacity_bytes:
            return {"parallelism": {"activation_checkpointing": True}}
        return None

    def feedback(self, change: dict, accepted: bool, before: WindowSummary,
                 after: WindowSummary | None) -> None:
        if not accepted:
            self.gave_up = True

    def state_dict(self) -> dict:
        return {"gave_up": self.gave_up}

    def load_state_dict(self, state: dict) -> None:
        self.gave_up = bool(state.get("gave_up", False))
'''

_TUNER_TEST = '''\
\"\"\"The ``__NAME__`` tuner: its proposals, the guard's feedback, its options.\"\"\"

from __future__ import annotations

import pytest

from dlrover_core import SpecError, load_spec
from dlrover_core.plugins.records import resolve
from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.tuner import WindowSummary

GIB = float(1 << 30)


def window(memory_gib: float, capacity_gib: float = 10.0) -> WindowSummary:
    return WindowSummary(version=0, steps=20, first_step=0, last_step=19, samples_per_s=500.0,
                         step_s=0.1, data_wait_s=0.01, compute_s=0.07, optimizer_s=0.02,
                         data_wait_share=0.1, memory_bytes=memory_gib * GIB,
                         memory_capacity_bytes=capacity_gib * GIB, prefetch_depth=-1.0,
                         world_size=2)


@pytest.fixture
def tuner(plugin_manager):
    record = plugin_manager.get_tuner("__NAME__")
    return resolve(record.tuner)({"memory_share": 0.8})


def test_proposes_activation_checkpointing_when_memory_is_short(tuner):
    change = tuner.propose(window(9.0), TuningConfig())
    assert change == {"parallelism": {"activation_checkpointing": True}}
    assert TuningConfig().updated(change, version=1).parallelism.activation_checkpointing
    assert tuner.propose(window(5.0), TuningConfig()) is None
    assert tuner.propose(window(9.0, capacity_gib=0.0), TuningConfig()) is None


def test_a_reverted_change_is_not_proposed_again(tuner):
    change = tuner.propose(window(9.0), TuningConfig())
    tuner.feedback(change, accepted=False, before=window(9.0), after=window(9.5))
    assert tuner.propose(window(9.0), TuningConfig()) is None
    restored = type(tuner)()
    restored.load_state_dict(tuner.state_dict())
    assert restored.propose(window(9.0), TuningConfig()) is None


@pytest.mark.parametrize("options,word", [({"memory_share": 1.5}, "memory_share"),
                                          ({"bogus": 1}, "bogus")])
def test_bad_options_fail_at_spec_load(options, word):
    with pytest.raises((SpecError, ValueError)) as exc:
        load_spec({"name": "t", "roles": {"trainer": {"workload": "a.b:C"}},
                   "tuning": {"enabled": True, "tuners": ["__NAME__"],
                              "options": {"__NAME__": options}}})
    assert word in str(exc.value)
'''

TUNER = Kind(
    name="tuner", summary="A tuner: step metrics -> a new versioned TuningConfig",
    provides=("tuner:__NAME__",), hooks=("dlrover_tuners",),
    files={"__PKG__/plugin.py": _TUNER_PLUGIN, "__PKG__/tuner.py": _TUNER_IMPL,
           "tests/test___NAME__.py": _TUNER_TEST},
    layout=(("__PKG__/tuner.py", "`__CLASS__Tuner`: `propose(window, current)` and "
             "`feedback(...)`"),),
    usage="In a job spec: `tuning: {enabled: true, tuners: [__NAME__], options: "
          "{__NAME__: {memory_share: 0.9}}}` (see the core's docs/tuning.md).\n")
