"""One way to declare and check a spec field (:mod:`dlrover_core.spec.fields`): the
words of an error come from the declared bounds, a value is converted and checked the
same way in the core spec, the tuning guard and the plugins' sections (no Ray here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from dlrover_core import SpecError, load_spec
from dlrover_core.spec.fields import Check, check_fields, read_fields, refuse_unknown, spec_field
from dlrover_core.spec.schema import JobSpec, TuningGuardSpec
from dlrover_core.tuning.guard import Guard

BASE = {"name": "j", "roles": {"trainer": {"workload": "a.b:C"}}}


@dataclass(frozen=True)
class Section:
    steps: int = spec_field(10, ge=1)
    timeout_s: float = spec_field(5.0, gt=0, unit="seconds", note="per try")
    share: float = spec_field(0.5, ge=0, lt=1, unit="a fraction")
    mode: str = spec_field("fast", choices=("fast", "exact"))
    limit: float | None = spec_field(None, ge=0)
    top: int = spec_field(20, valid=lambda v, s: v > s.steps, allowed=lambda s: f"> steps ({s.steps})")
    plain: bool = False


@pytest.mark.parametrize("check, kind, words", [
    (Check(ge=1), int, "an integer >= 1"),
    (Check(gt=0, unit="seconds", note="0: off"), float, "seconds > 0 (0: off)"),
    (Check(ge=0.5, lt=1), float, "a number in [0.5, 1)"),
    (Check(gt=0, le=1), float, "a number in (0, 1]"),
    (Check(le=8), int, "an integer <= 8"),
    (Check(choices=("a", "b")), str, "a, b"),
    (Check(ge=1, allowed="as I say"), int, "as I say"),
])
def test_the_words_come_from_the_bounds(check, kind, words):
    assert check.describe(kind) == words


def test_read_converts_like_the_spec_and_check_names_key_value_and_allowed():
    got = read_fields(Section, {"steps": 3.0, "limit": None, "mode": "exact"}, "config.x")
    assert got == {"steps": 3, "limit": None, "mode": "exact"} and type(got["steps"]) is int
    with pytest.raises(SpecError, match=r"config.x.steps: True is invalid; allowed: an "
                                        r"integer >= 1"):
        read_fields(Section, {"steps": True}, "config.x")
    with pytest.raises(SpecError, match=r"config.x.timeout_s: 'soon' is invalid; allowed: "
                                        r"seconds > 0 \(per try\)"):
        read_fields(Section, {"timeout_s": "soon"}, "config.x")
    check_fields(Section(), Section, "config.x")  # the defaults pass
    for change, match in [({"share": 1.0}, r"share: 1.0 .*a fraction in \[0, 1\)"),
                          ({"mode": "slow"}, r"mode: 'slow' .*allowed: fast, exact"),
                          ({"limit": -1.0}, r"limit: -1.0 .*a number >= 0"),
                          ({"top": 5}, r"config.x.top: 5 .*allowed: > steps \(10\)")]:
        with pytest.raises(SpecError, match=match):
            check_fields(Section(**change), Section, "config.x")
    with pytest.raises(SpecError, match=r"config.x.stps: 1 is invalid \(unknown\); allowed: "
                                        r"one of: steps, mode"):
        refuse_unknown({"steps": 2, "stps": 1}, ["steps", "mode"], "config.x", "unknown")


def test_nested_sections_are_walked_with_their_keys():
    spec = OmegaConf.structured(JobSpec)
    spec.tuning.guard.memory_headroom = 1.5
    with pytest.raises(SpecError, match=r"^tuning.guard.memory_headroom: 1.5 is invalid; "
                                        r"allowed: a fraction in \[0, 1\)$"):
        check_fields(spec, JobSpec)
    spec.tuning.guard.memory_headroom = 0.2
    spec.node_health.gpu_allgather_iters = 0
    with pytest.raises(SpecError, match=r"^node_health.gpu_allgather_iters: 0 is invalid"):
        check_fields(spec, JobSpec)


def test_the_guard_is_the_spec_sections_fields_and_checks():
    assert [f.name for f in dataclasses.fields(Guard)] == \
        [f.name for f in dataclasses.fields(TuningGuardSpec)]
    assert Guard(**OmegaConf.to_container(OmegaConf.structured(TuningGuardSpec))) == Guard()
    with pytest.raises(SpecError, match=r"tuning.guard.retry_shift: 0 is invalid; allowed: "
                                        r"a number > 0"):
        Guard(retry_shift=0)


def test_a_bad_guard_is_refused_before_anything_starts_even_with_tuning_off():
    """The guard's fields used to be checked only with ``tuning.enabled``."""
    with pytest.raises(SpecError, match=r"tuning.guard.windows: 1 is invalid; allowed: an "
                                        r"integer >= 2 \(the t-test needs two windows\)"):
        load_spec({**BASE, "tuning": {"guard": {"windows": 1}}})
    with pytest.raises(SpecError, match=r"roles.trainer.resources.gpu: -1.0 is invalid; "
                                        r"allowed: a number >= 0"):
        load_spec({**BASE, "roles": {"trainer": {"workload": "a.b:C",
                                                 "resources": {"gpu": -1}}}})
    assert load_spec(BASE).tuning.guard.windows == 3
