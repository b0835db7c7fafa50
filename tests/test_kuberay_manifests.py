"""The RayCluster and RayJob manifests of docs/kubernetes.md against the CRD OpenAPI
schemas of KubeRay v1.7.0 (vendored under vendored/kuberay-v1.7.0/), strictly: a
field the schema does not define is an error (as ``kubectl apply --validate=strict``;
the API server itself would silently drop it). No Kubernetes cluster is involved."""

from __future__ import annotations

import copy
import functools
import gzip
import os
import re
import shlex

import jsonschema
import pytest
import yaml

from dlrover_core.cli.main import build_parser, parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRDS = os.path.join(ROOT, "vendored", "kuberay-v1.7.0")
DOC = os.path.join(ROOT, "docs", "kubernetes.md")
FILES = {"RayCluster": "ray.io_rayclusters.yaml.gz", "RayJob": "ray.io_rayjobs.yaml.gz"}


def strict(schema: dict) -> dict:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    ``properties`` and neither allows extra keys nor preserves unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(schema)
    return schema


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str, version: str = "v1") -> dict:
    with gzip.open(os.path.join(CRDS, FILES[kind]), "rt") as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == kind
    v = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return strict(v["schema"]["openAPIV3Schema"])


def doc_manifests() -> dict[str, dict]:
    with open(DOC) as f:
        blocks = re.findall(r"```yaml\n(.*?)```", f.read(), flags=re.S)
    docs = [yaml.safe_load(b) for b in blocks]
    return {d["kind"]: d for d in docs}


def errors(kind: str, manifest: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(crd_schema(kind))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(manifest)]


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_doc_manifest_is_valid_for_kuberay_1_7(kind):
    manifest = doc_manifests()[kind]
    assert manifest["apiVersion"] == "ray.io/v1"
    assert errors(kind, manifest) == []


def test_strict_validation_catches_a_misspelt_and_a_mistyped_field():
    manifest = copy.deepcopy(doc_manifests()["RayCluster"])
    manifest["spec"]["workerGroupSpec"] = manifest["spec"].pop("workerGroupSpecs")
    manifest["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # not a string
    found = errors("RayCluster", manifest)
    assert any("workerGroupSpec" in e and "not allowed" in e for e in found), found
    assert any("num-cpus" in e and "not of type 'string'" in e for e in found), found


def test_manifests_share_the_job_volume_and_the_token():
    for kind, manifest in doc_manifests().items():
        spec = manifest["spec"] if kind == "RayCluster" else manifest["spec"]["rayClusterSpec"]
        assert spec["gcsFaultToleranceOptions"]["redisAddress"]
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for g in groups:
            pod = g["template"]["spec"]
            assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]] == \
                ["dlrover-jobs"]
            (c,) = pod["containers"]
            assert {"name": "jobs", "mountPath": "/jobs"} in c["volumeMounts"]
            env = {e["name"]: e for e in c["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == \
                "dlrover-ray-token"


def test_rayjob_entrypoint_is_a_dlrover_submit_our_cli_parses():
    argv = shlex.split(doc_manifests()["RayJob"]["spec"]["entrypoint"])
    assert argv[0] == "dlrover"
    args = parse_args(build_parser(), argv[1:])
    assert args.command == "submit" and args.job_dir.startswith("/jobs/")
