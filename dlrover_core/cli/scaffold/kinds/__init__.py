"""What each kind of scaffolded plugin contains, beyond :mod:`..common`: one module
per kind, each defining a :class:`~dlrover_core.cli.scaffold.kinds.base.Kind`."""

from __future__ import annotations

from dlrover_core.cli.scaffold.kinds.backend import BACKEND
from dlrover_core.cli.scaffold.kinds.base import Kind
from dlrover_core.cli.scaffold.kinds.classifier import CLASSIFIER
from dlrover_core.cli.scaffold.kinds.placement import PLACEMENT
from dlrover_core.cli.scaffold.kinds.saver import SAVER
from dlrover_core.cli.scaffold.kinds.template import TEMPLATE
from dlrover_core.cli.scaffold.kinds.tuner import TUNER

__all__ = ["KINDS", "Kind"]

KINDS: dict[str, Kind] = {k.name: k for k in (BACKEND, TEMPLATE, SAVER, PLACEMENT, CLASSIFIER,
                                              TUNER)}
