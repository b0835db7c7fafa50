"""Entry point of the ``multimodal`` plugin: the ``multimodal`` graph template.

Imports nothing heavy (no torch): the driver and the workload base classes are
named by import path and loaded only in the processes that run them.

Roles: ``trainer`` (required; the fusion model or projector, SPMD under any
installed backend) and one encoder role per modality of the data, named in
``config.multimodal.encoders`` (``vision_encoder``, ``text_encoder``, any names).
The driver :class:`dlrover_plugin_multimodal.driver.MultimodalDriver` streams
batches: per step it hands sample ids to every encoder role, and the encoders'
outputs reach the trainer as ``DRef`` s, worker to worker.

Failover (see the plugin's README): ``roles.<role>.config.failover`` is ``rollback`` for
the trainer (restored to the driver's last commit) and ``replace`` for the encoders (a
failed rank is replaced while the driver keeps running and retries the step's calls).
"""

from __future__ import annotations

from typing import Any

from dlrover_core import GraphTemplate, RoleTemplate, SpecError, hookimpl

DRIVER = "dlrover_plugin_multimodal.driver:MultimodalDriver"
TEMPLATE = "multimodal"

#: failover policy of a role unless ``roles.<role>.config.failover`` says otherwise: the
#: trainer (stateful, committed by the driver) rolls back to the driver's last commit;
#: every other role is an encoder (stateless: a frozen encoder's cache is reloaded, a
#: trainable one's network lives in the trainer) and is ``replace``d under the running
#: driver, which retries the step's calls on the replacement
FAILOVER_DEFAULTS = {"trainer": "rollback"}


def _trainer_group(spec: Any) -> list[str]:
    for group in spec.collocation:
        if "trainer" in group:
            return list(group)
    return []


def apply_multimodal(spec: Any) -> None:
    """Template defaults and checks for ``multimodal``, in the client before anything
    starts:

    - ``config.multimodal`` is read and validated
      (:class:`~dlrover_plugin_multimodal.config.MultimodalConfig`), including that
      every modality named in ``data.modalities`` has an encoder role;
    - the job has a ``trainer`` role, every other role is an encoder named in
      ``config.multimodal.encoders`` and every encoder there is a role;
    - a trainable encoder shares bundles with the trainer (``collocation``);
    - ``batch_size`` splits evenly over the trainer ranks and gives every encoder
      rank at least one sample;
    - ``edges`` default to ``encoder -> trainer`` for each encoder, and each encoder
      entry gets its role's ``workload`` import path;
    - ``roles.<role>.config.failover`` defaults to ``rollback`` for the trainer and
      ``replace`` for every encoder (:data:`FAILOVER_DEFAULTS`): a failed encoder rank is
      replaced while the driver keeps running and retries the step's calls on it.

    Raises:
        SpecError: naming the key, the value and what is allowed.
    """
    from omegaconf import OmegaConf

    from dlrover_core.graph.graph import set_failover_policies
    from dlrover_plugin_multimodal.config import KEY, TRAINER, MultimodalConfig

    if spec.config is None or not OmegaConf.is_dict(spec.config):
        if spec.config not in (None, {}):
            raise SpecError("config", spec.config, "a mapping (the job config)")
        spec.config = {}
    roles = spec.roles
    if TRAINER not in roles:
        raise SpecError(f"roles.{TRAINER}", None,
                        "a trainer role plus one encoder role per modality",
                        f"template {TEMPLATE!r} requires role {TRAINER!r}")
    mm = MultimodalConfig.from_config(spec.config)
    for role in roles:
        if role != TRAINER and role not in mm.encoders:
            raise SpecError(f"roles.{role}", role,
                            "trainer or an encoder named in config.multimodal.encoders: "
                            + ", ".join(mm.encoders),
                            f"add {KEY}.encoders.{role}: {{modality: <name>}}")
    for role in mm.encoders:
        if role not in roles:
            raise SpecError(f"{KEY}.encoders.{role}", role,
                            "a role of this job: " + ", ".join(roles),
                            f"add roles.{role}.workload=package.module:Class")
    group = _trainer_group(spec)
    for enc in mm.trainable:
        if enc.role not in group:
            raise SpecError(
                "collocation", OmegaConf.to_container(spec.collocation),
                f"a collocation group with trainer and {enc.role}",
                f"{enc.role} is trainable: its network is part of the trainer's model, so "
                f"its role shares the trainer's bundles; e.g. collocation: "
                f"[[trainer, {enc.role}]]")
    n = roles[TRAINER].total
    if n >= 1 and mm.batch_size % n:
        raise SpecError(f"{KEY}.batch_size", mm.batch_size,
                        f"a multiple of roles.trainer.total={n}",
                        "each trainer rank trains on an equal share of a step's samples")
    for role in mm.encoders:
        m = roles[role].total
        if m > mm.batch_size:
            raise SpecError(f"roles.{role}.total", m,
                            f"at most {KEY}.batch_size={mm.batch_size}",
                            "every encoder rank gets a contiguous share of a step's samples")
    mm = mm.with_workloads({r: roles[r].workload for r in mm.encoders})
    spec.config.multimodal = mm.as_dict()
    set_failover_policies(roles, FAILOVER_DEFAULTS, "replace")
    if not spec.edges:
        spec.edges = [[role, TRAINER] for role in mm.encoders]


@hookimpl
def dlrover_graph_templates() -> list[GraphTemplate]:
    # the encoder roles are named by the job (any number): a pattern role;
    # apply_multimodal checks every role but the trainer against config.multimodal.encoders
    return [GraphTemplate(
        name=TEMPLATE,
        description="encoders -> fusion trainer: roles 'trainer' (required) and one encoder "
                    "role per modality (config.multimodal.encoders), frozen or trainable; "
                    "embeddings move to the trainer as DRefs",
        roles=(RoleTemplate("trainer", True, "the fusion model or projector, SPMD under a "
                            "backend; gets every encoder's output"),
               RoleTemplate("<modality>_encoder", False, "one role per modality, any name "
                            "(vision_encoder, text_encoder), each an entry of "
                            "config.multimodal.encoders", pattern=True)),
        edges=(),
        driver=DRIVER,
        apply=apply_multimodal,
    )]
