"""The ``deepspeed`` state-dict engine: a ``DeepSpeedEngine`` as one saveable state dict.

``objects["model"]`` is the ``DeepSpeedEngine`` (what ``DeepSpeedSession.wrap``
returns); its optimizer is taken from the engine (an ``optimizer`` entry, if given,
must be ``engine.optimizer`` or is ignored). The state dict holds

- ``model``: ``engine.module.state_dict()`` (full parameters: ZeRO 0-2 keep them on
  every rank);
- ``optimizer``: ``engine.optimizer.state_dict()``: for ZeRO 1/2 this rank's
  partition of the fp32 master weights and of the base optimizer state (plain tensors,
  padding removed), the loss scaler and the partition layout;
- ``engine``: ``global_steps``, ``global_samples``, ``skipped_steps`` and the
  ``lr_scheduler`` state when the engine has one;
- every other entry of ``objects`` as the plain engine handles it (dicts of step,
  RNG, data position).

Restore is into the same data-parallel world size (each rank reloads its own
partition, fp32 master weights included, so the round trip is bit-exact).
ZeRO stage 3 is not supported by this engine.
"""

from __future__ import annotations

from typing import Any

from dlrover_core.checkpoint.engine import StateDictEngineBase


def _split(objects: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    engine = objects.get("model")
    rest = {k: v for k, v in objects.items() if k not in ("model", "optimizer", "engine")}
    if engine is None or not hasattr(engine, "module") or not hasattr(engine, "optimizer"):
        raise TypeError(f"the deepspeed state-dict engine needs objects['model'] to be a "
                        f"DeepSpeedEngine (from backend.wrap), got {type(engine).__name__}")
    stage = engine.zero_optimization_stage()
    if stage >= 3:
        raise NotImplementedError(f"ZeRO stage {stage} is not supported by the deepspeed "
                                  "state-dict engine; use zero_optimization.stage 0, 1 or 2")
    if stage > 0 and engine.zero_elastic_checkpoint():
        raise NotImplementedError("zero_optimization.elastic_checkpoint=true is not supported: "
                                  "the engine restores each rank's own partition")
    return engine, rest


class DeepSpeedEngineState(StateDictEngineBase):
    """State dict of a ``DeepSpeedEngine`` (ZeRO stages 0-2), see the module docstring."""

    def state_dict(self, objects: dict[str, Any]) -> dict:
        engine, rest = _split(objects)
        out = super().state_dict(rest)
        out["model"] = engine.module.state_dict()
        if engine.optimizer is not None:
            out["optimizer"] = engine.optimizer.state_dict()
        counters = {"global_steps": int(engine.global_steps),
                    "global_samples": int(engine.global_samples),
                    "skipped_steps": int(engine.skipped_steps)}
        if engine.lr_scheduler is not None and hasattr(engine.lr_scheduler, "state_dict"):
            counters["lr_scheduler"] = engine.lr_scheduler.state_dict()
        out["engine"] = counters
        return out

    def load_state_dict(self, objects: dict[str, Any], state_dict: dict) -> None:
        import deepspeed.comm as ds_dist

        engine, rest = _split(objects)
        super().load_state_dict(rest, state_dict)
        engine.module.load_state_dict(state_dict["model"], strict=True)
        if engine.optimizer is not None and "optimizer" in state_dict:
            if engine.zero_optimization_stage() > 0:
                dp_world = ds_dist.get_world_size(group=engine.optimizer.dp_process_group)
                # the rigid (non-elastic) path reads only this rank's entry of the list
                engine.optimizer.load_state_dict([state_dict["optimizer"]] * dp_world,
                                                 load_optimizer_states=True,
                                                 load_from_fp32_weights=True)
            else:
                engine.optimizer.load_state_dict(state_dict["optimizer"])
        counters = state_dict.get("engine", {})
        engine.global_steps = int(counters.get("global_steps", engine.global_steps))
        engine.global_samples = int(counters.get("global_samples", engine.global_samples))
        engine.skipped_steps = int(counters.get("skipped_steps", engine.skipped_steps))
        if "lr_scheduler" in counters and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(counters["lr_scheduler"])
