"""Entry point of the ``sft`` plugin: the ``sft`` graph template.

``sft`` (supervised fine-tuning and pre-training): one SPMD role ``trainer`` whose
workload runs its own loop (``BaseWorkload.run``) under a backend (``ddp``,
``fsdp``, ...), and an optional ``eval`` role fed by the trainer (edge
``trainer -> eval``). There is no driver.
"""

from __future__ import annotations

from typing import Any

from dlrover_core import GraphTemplate, RoleTemplate, SpecError, hookimpl


def apply_sft(spec: Any) -> None:
    """Template defaults: the trainer gets ``backend: ddp`` when none is set; an SFT job
    has no driver."""
    if spec.driver is not None:
        raise SpecError("driver", spec.driver, "no driver for template 'sft'",
                        "the trainer role runs its own loop (BaseWorkload.run)")
    if spec.roles.trainer.backend is None:
        spec.roles.trainer.backend = "ddp"


@hookimpl
def dlrover_graph_templates() -> list[GraphTemplate]:
    return [GraphTemplate(
        name="sft",
        description="one SPMD trainer group (pre-training / supervised fine-tuning)",
        roles=(RoleTemplate("trainer", True, "SPMD training loop under a backend"),
               RoleTemplate("eval", False, "optional evaluation workers")),
        edges=(("trainer", "eval"),),
        driver=None,
        apply=apply_sft,
    )]
