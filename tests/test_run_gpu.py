"""GPU script roles from ``dlrover-run --nnodes 2 --nproc-per-node gpu`` on a cluster of
two GPU nodes. This machine has no GPU: the GPUs are Ray resources only (``num_gpus``
declared on ``ray.cluster_utils`` nodes), which is what Ray reserves and what dlrover
computes ``CUDA_VISIBLE_DEVICES`` from (never from CUDA). Checked: the rank count comes
from the cluster's nodes (the submitting host has no GPU), the two node groups land on
two distinct nodes, each rank holds one GPU of its own, and ``CUDA_VISIBLE_DEVICES``
lists its node's GPUs with the rank's own at index ``LOCAL_RANK`` (so that
``set_device(LOCAL_RANK)`` picks it). The command line is a torchrun line written for
two nodes (``--node-rank 0 --rdzv-endpoint HOST:PORT``), given once with ``--address``."""

from __future__ import annotations

import json

import pytest

from dlrover_core.cli import run as dlrover_run
from dlrover_core.testing import multinode_cluster

SCRIPT = '''
import json, os, sys

keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "CUDA_VISIBLE_DEVICES", "DLROVER_NODE_ID")
with open(os.path.join(sys.argv[1], "gpu-%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
'''


@pytest.fixture(scope="module")
def gpu_cluster():
    """A head without GPUs and two worker nodes that declare 2 GPUs each."""
    with multinode_cluster(2, cpus=2, head_cpus=1, gpus=2) as (cluster, nodes):
        yield cluster, set(nodes)


@pytest.mark.slow  # three Ray nodes started for one test (17 s here)
def test_two_gpu_node_groups_on_two_nodes_one_gpu_per_rank(gpu_cluster, tmp_path,
                                                            monkeypatch):
    cluster, gpu_nodes = gpu_cluster
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    (tmp_path / "probe.py").write_text(SCRIPT)
    # a torchrun line written for 2 nodes (rendezvous at the head), given once
    code = dlrover_run.main(["--address", cluster.address, "--nnodes", "2",
                             "--node-rank", "0", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", "head-node:29400",
                             "--nproc-per-node", "gpu", "--cpus-per-rank", "0.5",
                             "--job-dir", str(tmp_path / "job"), "--quiet",
                             "probe.py", str(tmp_path)])
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert code == 0, summary
    seen = [json.loads((tmp_path / f"gpu-{r}.json").read_text()) for r in range(4)]
    assert [s["WORLD_SIZE"] for s in seen] == ["4"] * 4  # 2 GPUs on each node, 2 nodes
    by_node: dict[str, list[dict]] = {}
    for s in seen:
        by_node.setdefault(s["DLROVER_NODE_ID"], []).append(s)
    assert set(by_node) == gpu_nodes  # the two node groups on the two GPU nodes
    for ranks in by_node.values():
        assert sorted(s["LOCAL_RANK"] for s in ranks) == ["0", "1"]
        assert len({s["GROUP_RANK"] for s in ranks}) == 1
        own = set()
        for s in ranks:
            visible = s["CUDA_VISIBLE_DEVICES"].split(",")
            assert sorted(visible) == ["0", "1"]  # the node's GPUs, as under torchrun
            own.add(visible[int(s["LOCAL_RANK"])])
        assert own == {"0", "1"}  # cuda:LOCAL_RANK is a GPU of its own on each rank
