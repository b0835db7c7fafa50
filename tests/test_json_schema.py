"""``dlrover schema`` (issue 52): the job spec's JSON Schema, generated from the spec
classes, accepts every example job file and refuses what the loader refuses (unknown
keys, wrong types, unregistered names), so an editor's yaml-language-server checks
``job.yaml`` as ``dlrover validate`` would."""

from __future__ import annotations

import glob
import json
import os

import jsonschema
import pytest
import yaml

from dlrover_core.cli.main import main
from dlrover_core.spec.errors import SpecError
from dlrover_core.spec.loader import load_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*", "*.yaml")))


@pytest.fixture(scope="module")
def validator(tmp_path_factory):
    out = tmp_path_factory.mktemp("schema") / "job.schema.json"
    assert main(["schema", "-o", str(out)]) == 0
    schema = json.loads(out.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_there_are_examples_to_check():
    assert len(EXAMPLES) >= 8, EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_example_job_file_is_valid(validator, path):
    with open(path) as f:
        doc = yaml.safe_load(f)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, errors


BAD = {
    "unknown key": ({"checkpoint": {"every_step": 5}}, "every_step"),
    "wrong type": ({"roles": {"trainer": {"workload": "a.b:C", "total": "four"}}}, "total"),
    "unregistered saver": ({"checkpoint": {"saver": "nosuchsaver"}}, "saver"),
    "unregistered template": ({"template": "nosuchtemplate"}, "template"),
    "unknown role key": ({"roles": {"trainer": {"workload": "a.b:C", "totl": 2}}}, "totl"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_the_loader_refuses_the_schema_refuses(validator, case):
    extra, key = BAD[case]
    doc = {"name": "x", "roles": {"trainer": {"workload": "tests.cli_workloads:Chatty"}},
           **extra}
    errors = list(validator.iter_errors(doc))
    assert errors, f"{case}: the schema accepted {doc}"
    assert any(key in (e.message + str(list(e.path))) for e in errors), \
        [e.message for e in errors]
    with pytest.raises(SpecError):  # and the loader agrees it is bad
        load_spec(doc)


def test_a_job_without_a_name_is_refused(validator):
    errors = list(validator.iter_errors({"roles": {}}))
    assert any("'name' is a required property" in e.message for e in errors)


def test_schema_without_plugins_has_no_enums(capsys):
    assert main(["schema", "--no-plugins"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "enum" not in json.dumps(schema["properties"]["template"])
    assert schema["$defs"]["RoleSpec"]["properties"]["total"] == {"type": "integer",
                                                                  "default": 1}
