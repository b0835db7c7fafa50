"""Token authentication is turned on for a client only when the cluster wants it."""

from __future__ import annotations

import os

import pytest
from ray.cluster_utils import Cluster

from dlrover_core.master import ray_auth


@pytest.fixture
def token_home(tmp_path, monkeypatch):
    """A home with ``~/.ray/auth_token`` (as ``ray start --head`` leaves it), and no
    authentication settings in the environment."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("a" * 64)
    monkeypatch.setenv("HOME", str(tmp_path))
    for key in (ray_auth.AUTH_MODE, ray_auth.TOKEN, ray_auth.TOKEN_PATH):
        monkeypatch.setenv(key, "")  # recorded, so that teardown restores it ...
        monkeypatch.delenv(key)  # ... after prepare_token_auth may have set it
    yield tmp_path
    monkeypatch.undo()
    ray_auth._reload_ray_config()  # Ray's cached mode follows the restored environment


def test_a_token_file_alone_does_not_turn_auth_on_for_a_cluster_without_it(token_home):
    """The scenario's bug: with ~/.ray/auth_token present, joining a head started without
    authentication set RAY_AUTH_MODE=token in the driver, so a node it added later (its
    raylet inherits the environment) refused the GCS and no placement group on it ever
    became ready."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0,
                                                            "include_dashboard": False})
    try:
        assert ray_auth.token_source() == str(token_home / ".ray" / "auth_token")
        assert ray_auth.probe_gcs(cluster.address, None) == "ok"
        assert ray_auth.prepare_token_auth(cluster.address) is not None
        assert ray_auth.AUTH_MODE not in os.environ
        ray_auth.check_token(cluster.address)  # the cluster accepts us as we are
    finally:
        cluster.shutdown()


def test_an_address_that_cannot_be_asked_keeps_the_token_on(token_home):
    """An address the probe cannot ask (nothing listens there) keeps the old rule: a
    token that is found is presented."""
    ray_auth.prepare_token_auth("127.0.0.1:1")
    assert os.environ.get(ray_auth.AUTH_MODE) == "token"
