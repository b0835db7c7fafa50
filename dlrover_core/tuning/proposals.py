"""One round of proposals: ask the tuners for their changes to a config and merge
them (used by :class:`~dlrover_core.tuning.controller.TuningController`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from dlrover_core.tuning.config import TuningConfig
from dlrover_core.tuning.tuner import TunerBase, WindowSummary

if TYPE_CHECKING:
    from dlrover_core.tuning.guard import Guard


def ask_tuners(tuners: list[tuple[str, TunerBase]], window: WindowSummary,
               config: TuningConfig, first: int | None,
               refused: Callable[[TuningConfig], bool],
               failed: Callable[[str, str, BaseException], None],
               ) -> tuple[dict[str, dict], dict[str, dict], int | None]:
    """Ask ``tuners`` (``(name, tuner)`` in priority order) for a change to ``config``
    given the last measured ``window``.

    ``first`` is ``None`` to merge every tuner's change (an earlier tuner's change to a
    key wins; a later change touching a claimed key is dropped whole), or the index of
    the tuner asked first for one change per round: the first tuner, going round from
    there, whose change is valid and not ``refused`` (tried and reverted, or over the
    memory ceiling) gives the round's only change. A tuner that raises, or proposes
    an invalid change, is reported through ``failed(name, "propose", exc)`` and
    skipped.

    Returns ``(merged, by_tuner, turn)``: the merged change (``{section: {key:
    value}}``), each contributing tuner's own change, and the index of the tuner to
    ask first next round (``None`` when no tuner contributed).
    """
    merged: dict[str, dict] = {}
    claimed: dict[tuple[str, str], str] = {}
    by_tuner: dict[str, dict] = {}
    turn = None
    order = list(range(len(tuners)))
    if first is not None:
        order = order[first:] + order[:first]
    for idx in order:
        if first is not None and by_tuner:
            break
        name, tuner = tuners[idx]
        try:
            change = tuner.propose(window, config)
            if not change:
                continue
            config.updated(change)  # validates keys and values
        except Exception as exc:  # noqa: BLE001 - a broken tuner is skipped, not fatal
            failed(name, "propose", exc)
            continue
        keys = {(s, k) for s, kv in change.items() for k in kv}
        if any(k in claimed for k in keys):
            continue  # an earlier tuner already changes one of these keys
        if first is not None and refused(config.updated(change)):
            continue  # tried and reverted before: let the next tuner have the turn
        for s, k in keys:
            claimed[(s, k)] = name
            merged.setdefault(s, {})[k] = change[s][k]
        by_tuner[name] = change
        turn = (idx + 1) % len(tuners)
    return merged, by_tuner, turn


def pick_retry(rejected: list[dict], guard: Guard, config: TuningConfig,
               window: WindowSummary, over_ceiling: Callable[[TuningConfig], bool],
               settings_moved: bool = False,
               ) -> tuple[TuningConfig, dict[str, dict]] | None:
    """The first reverted change (``rejected``: the controller's records ``{"settings",
    "change", "tuners", "baseline", "retries"}``) with retries left under
    ``guard.max_retries`` whose conditions moved since its revert and that still
    changes ``config`` within the memory ceiling: ``(the new config, each tuner's
    change)``, its ``retries`` counted; ``None`` when there is none.

    The conditions moved when the measurements did (``guard.conditions_changed``
    between its baseline and ``window``), or, with ``settings_moved``, when a setting
    the change does not touch is different now (another tuner's change was kept
    since: a micro-batch doubling reverted while two loader workers could not feed it
    is another trial with four; the controller asks for these only when no tuner has
    a proposal)."""
    for rec in rejected:
        if rec["retries"] >= guard.max_retries or not rec.get("baseline"):
            continue
        change = {s: {k: v[1] for k, v in kv.items()} for s, kv in rec["change"].items()}
        if settings_moved:
            if not _others_changed(rec, config):
                continue
        elif not guard.conditions_changed(WindowSummary.from_dict(rec["baseline"]), window):
            continue
        new = config.updated(change, version=config.version + 1)
        if new.same_settings(config) or over_ceiling(new):
            continue  # nothing left to change, or known not to fit in memory
        rec["retries"] += 1
        return new, {n: {s: dict(kv) for s, kv in change.items()} for n in rec["tuners"]}
    return None


def _others_changed(rec: dict, config: TuningConfig) -> bool:
    """Is a setting the reverted change ``rec`` does not touch different in ``config``
    from what it was in the reverted settings?"""
    moved = TuningConfig.from_dict(rec["settings"]).diff(config)
    return any(k not in rec["change"].get(s, {}) for s, kv in moved.items() for k in kv)
