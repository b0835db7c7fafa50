"""Validation of the job spec's ``tuning`` section (called by the spec loader).

Every error is a ``SpecError`` naming the dotted key, the bad value and what is
allowed; an unknown tuner lists the installed ones. Tuner options are checked by the
tuner class's own ``validate_options`` (the class is imported in the client, so tuner
modules must stay light).
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from dlrover_core.spec.errors import SpecError
from dlrover_core.tuning.lr_scaling import LR_SCALING_RULES


def tuned_role(spec: Any) -> str:
    """The role tuning applies to: ``tuning.role``, else the only role with a backend,
    else the only role.

    Raises:
        SpecError: no such role, or several candidates and no ``tuning.role``.
    """
    t = spec.tuning
    roles = list(spec.roles)
    if t.role is not None:
        if t.role not in spec.roles:
            raise SpecError("tuning.role", t.role, "a role of the job: " + ", ".join(roles))
        return str(t.role)
    with_backend = [r for r in roles if spec.roles[r].backend]
    if len(with_backend) == 1:
        return with_backend[0]
    if len(roles) == 1:
        return roles[0]
    raise SpecError("tuning.role", None, "one of " + ", ".join(roles),
                    "several roles could be tuned; name one")


def validate_tuning(spec: Any, plugin_manager: Any) -> None:
    """Check ``spec.tuning`` (only when ``tuning.enabled``; the types, and the ranges
    of ``interval_steps``, ``warmup_steps`` and ``tuning.guard``, are checked with the
    schema: ``dlrover_core.spec.fields``).

    Raises:
        SpecError: a bad value, an unknown tuner (lists the installed ones), options for
            a tuner nobody installed, or options the tuner refuses.
    """
    from dlrover_core.plugins.manager import UnknownPluginError
    from dlrover_core.plugins.records import resolve

    t = spec.tuning
    if not t.enabled:
        return
    if t.lr_scaling not in LR_SCALING_RULES:
        raise SpecError("tuning.lr_scaling", t.lr_scaling, ", ".join(LR_SCALING_RULES))
    if not t.tuners:
        installed = ", ".join(sorted(plugin_manager.tuners())) or "none"
        raise SpecError("tuning.tuners", [], f"a list of installed tuners: {installed}")
    tuned_role(spec)
    names = list(t.tuners)
    classes = {}
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise SpecError(f"tuning.tuners[{i}]", name, "each tuner once")
        try:
            rec = plugin_manager.get_tuner(name)
        except UnknownPluginError as exc:
            raise SpecError(f"tuning.tuners[{i}]", name, "an installed tuner", str(exc)) from None
        try:
            classes[name] = resolve(rec.tuner)
        except (ImportError, AttributeError, ValueError) as exc:
            raise SpecError(f"tuning.tuners[{i}]", name, "a tuner whose class imports",
                            f"{rec.tuner}: {type(exc).__name__}: {exc}") from None
    options = OmegaConf.to_container(t.options, resolve=True) if OmegaConf.is_config(
        t.options) else dict(t.options or {})
    installed = plugin_manager.tuners()
    for name, opts in options.items():
        key = f"tuning.options.{name}"
        if name not in classes:  # options of an installed tuner not selected now: checked too
            if name not in installed:
                raise SpecError(key, opts, "options of an installed tuner: "
                                + ", ".join(sorted(installed)))
            try:
                classes[name] = resolve(installed[name].tuner)
            except (ImportError, AttributeError, ValueError) as exc:
                raise SpecError(key, opts, "options of a tuner whose class imports",
                                f"{type(exc).__name__}: {exc}") from None
        if not isinstance(opts, dict):
            raise SpecError(key, opts, "a mapping of option -> value")
        try:
            classes[name].validate_options(opts)
        except (ValueError, TypeError) as exc:
            bad = str(exc).split(":", 1)[0]
            raise SpecError(f"{key}.{bad}" if bad in opts else key, opts.get(bad, opts),
                            f"options of tuner {name!r}", str(exc)) from None


def controller_arguments(spec: Any, plugin_manager: Any) -> dict | None:
    """The arguments of :class:`~dlrover_core.tuning.controller.TuningController` (all
    but ``store`` and ``emit``) for a validated job spec, or ``None`` when tuning is
    off. Tuner classes are resolved through the plugin manager's ``dlrover_tuners``
    and built with their ``tuning.options.<name>``.

    Raises:
        UnknownPluginError: a tuner name nobody provides (:func:`validate_tuning`
            checks this before anything starts).
    """
    from dlrover_core.plugins.records import resolve
    from dlrover_core.tuning.guard import Guard

    t = spec.tuning
    if not t.enabled:
        return None
    options = dict(t.options or {})
    tuners = []
    for name in t.tuners:
        rec = plugin_manager.get_tuner(name)
        tuners.append((name, resolve(rec.tuner)(dict(options.get(name) or {}))))
    role = tuned_role(spec)
    return dict(tuners=tuners, role=role, world_size=int(spec.roles[role].total),
                interval_steps=int(t.interval_steps), warmup_steps=int(t.warmup_steps),
                guard=Guard(**OmegaConf.to_container(t.guard)),
                lr_scaling=str(t.lr_scaling),
                one_change_per_round=bool(t.one_change_per_round))
