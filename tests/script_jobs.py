"""A torchrun-style script run as a script role of two ranks on one node: the job the
script-role tests share (each test writes its own script)."""

from __future__ import annotations

from pathlib import Path

from dlrover_core import DLJobBuilder


def run_two_ranks(tmp_path: Path, monkeypatch, name: str, file_name: str, source: str,
                  target: str) -> dict:
    """Write ``source`` to ``tmp_path/file_name``, make ``tmp_path`` the working
    directory (``monkeypatch.chdir``), and run ``target`` (``"module:function args"``)
    as job ``name``: a script role of two ranks on one node, 0.5 CPU each, job
    directory ``tmp_path/job``. Needs a Ray cluster (the ``ray_cluster`` fixture).

    Returns:
        The job summary, once asserted ``succeeded``.
    """
    monkeypatch.chdir(tmp_path)
    (tmp_path / file_name).write_text(source)
    job = (DLJobBuilder().name(name).train(target).nnodes(1).nproc_per_node(2)
           .resource(cpu=0.5).build())
    summary = job.submit(job_dir=str(tmp_path / "job"))
    assert summary["status"] == "succeeded", summary["error"]
    return summary
