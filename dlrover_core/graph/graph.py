"""The computation graph of a job: roles, data-flow edges and collocation groups.

A *role* is a group of ``total`` identical instances (SPMD ranks) of one workload.
Its *failover policy* (``roles.<role>.config.failover``, :data:`FAILOVER_POLICIES`)
says what a failure of it costs in a job with a driver: ``replace`` (a stateless role:
the failed rank is replaced and the driver, which keeps running, retries its call on
the replacement) or ``rollback`` (the default: the failed rank is replaced, the driver
restarts and rolls the roles back to its last commit).
An *edge* ``(a, b)`` says that results of role ``a`` feed role ``b``; edges must
form a DAG. A *collocation group* is a set of roles whose instances share
bundles (devices): bundle ``i`` of the group hosts instance ``i`` of each role.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from graphlib import CycleError, TopologicalSorter
from typing import Any

from dlrover_core.spec.errors import SpecError

#: values of ``roles.<role>.config.failover`` (see the module docstring)
FAILOVER_POLICIES = ("replace", "rollback")


def check_failover_policy(role: str, value: object) -> str:
    """``value`` of ``roles.<role>.config.failover`` (``None``: ``rollback``).

    Raises:
        SpecError: not one of :data:`FAILOVER_POLICIES`.
    """
    if value is None:
        return "rollback"
    if value not in FAILOVER_POLICIES:
        raise SpecError(f"roles.{role}.config.failover", value, ", ".join(FAILOVER_POLICIES),
                        "replace: a stateless role, replaced while the driver retries its "
                        "call; rollback: the driver restarts from its last commit")
    return str(value)


def set_failover_policies(roles: Any, defaults: dict[str, str], fallback: str) -> None:
    """Write ``roles.<role>.config.failover`` of every role of a spec being validated
    (``spec.roles``: role name -> role spec whose ``config`` is a mapping or ``None``):
    the value given, checked, else ``defaults[role]``, else ``fallback``; for a graph
    template that knows which of its roles are stateless.

    Raises:
        SpecError: a given value is not one of :data:`FAILOVER_POLICIES`.
    """
    for name, role in roles.items():
        given = role.config.get("failover") if role.config is not None else None
        policy = check_failover_policy(name, given) if given is not None else \
            defaults.get(name, fallback)
        if role.config is None:
            role.config = {}
        role.config.failover = policy


@dataclass(frozen=True)
class Resources:
    """Per-instance resources: ``cpu``/``gpu`` in units, ``memory_mb`` in MiB."""

    cpu: float = 1.0
    gpu: float = 0.0
    memory_mb: int = 0

    def as_ray(self, fraction: float = 1.0) -> dict[str, float]:
        """Ray resource dict (``CPU``, ``GPU``, ``memory`` in bytes) scaled by ``fraction``."""
        out = {"CPU": self.cpu * fraction}
        if self.gpu:
            out["GPU"] = self.gpu * fraction
        if self.memory_mb:
            out["memory"] = self.memory_mb * 1024 * 1024 * fraction
        return out


@dataclass(frozen=True)
class Role:
    """One role of the graph."""

    name: str
    workload: str
    total: int
    per_node: int
    backend: str | None = None
    resources: Resources = field(default_factory=Resources)
    env: tuple[tuple[str, str], ...] = ()
    config: Any = None

    @property
    def num_nodes(self) -> int:
        """Nodes the role spans: ``total / per_node``."""
        return self.total // self.per_node


@dataclass(frozen=True)
class CollocationGroup:
    """Roles sharing bundles. ``size`` bundles; bundle ``i`` hosts rank ``i`` of every
    role whose ``total`` exceeds ``i``."""

    roles: tuple[str, ...]
    size: int
    per_node: int


class ComputationGraph:
    """Roles, edges, collocation groups and the optional driver of one job.

    Raises:
        SpecError: an edge or collocation names a missing role, edges form a cycle,
            a role appears in two collocation groups, or collocated roles disagree
            on ``per_node``.
    """

    def __init__(
        self,
        roles: list[Role],
        edges: list[tuple[str, str]] = (),  # type: ignore[assignment]
        collocation: list[list[str]] = (),  # type: ignore[assignment]
        driver: str | None = None,
        node_num: int = 0,
    ) -> None:
        #: the job's ``node_num`` (0: not set): placement puts a role's node slots on
        #: distinct nodes when it is set
        self.node_num = node_num
        self.roles: dict[str, Role] = {r.name: r for r in roles}
        self.edges: list[tuple[str, str]] = [tuple(e) for e in edges]  # type: ignore[misc]
        self.driver = driver
        names = ", ".join(sorted(self.roles)) or "none"
        for i, edge in enumerate(self.edges):
            if len(edge) != 2:
                raise SpecError(f"edges[{i}]", list(edge), "a pair [src_role, dst_role]")
            for j, r in enumerate(edge):
                if r not in self.roles:
                    raise SpecError(f"edges[{i}][{j}]", r, f"a role of this job: {names}")
        self.order = self._topological_order()
        self.groups = self._groups(collocation, names)
        for name in self.roles:
            self.failover_policy(name)  # raises SpecError for a value not allowed

    def _topological_order(self) -> list[str]:
        ts: TopologicalSorter = TopologicalSorter({r: set() for r in self.roles})
        for src, dst in self.edges:
            ts.add(dst, src)
        try:
            return list(ts.static_order())
        except CycleError as exc:
            cycle = " -> ".join(exc.args[1][::-1])
            raise SpecError("edges", [list(e) for e in self.edges], "a DAG (no cycles)",
                            f"cycle {cycle}") from None

    def _groups(self, collocation: list[list[str]], names: str) -> list[CollocationGroup]:
        seen: dict[str, int] = {}
        groups = []
        for gi, group in enumerate(collocation):
            group = list(group)
            if not group:
                raise SpecError(f"collocation[{gi}]", group, "a non-empty list of role names")
            for j, r in enumerate(group):
                if r not in self.roles:
                    raise SpecError(f"collocation[{gi}][{j}]", r, f"a role of this job: {names}")
                if r in seen:
                    raise SpecError(f"collocation[{gi}][{j}]", r,
                                    "each role in at most one collocation group",
                                    f"already in collocation[{seen[r]}]")
                seen[r] = gi
            lead = max(group, key=lambda r: self.roles[r].total)
            per_node = self.roles[lead].per_node
            odd = [r for r in group if self.roles[r].per_node != per_node
                   and not (self.roles[r].total <= per_node
                            and self.roles[r].per_node == self.roles[r].total)]
            if odd:
                raise SpecError(f"collocation[{gi}]", group,
                                f"roles with the same per_node (or at most {per_node} instances)",
                                "per_node differs: " + ", ".join(
                                    f"{r}={self.roles[r].per_node}" for r in group))
            groups.append(CollocationGroup(tuple(group), self.roles[lead].total, per_node))
        for name in self.order:
            if name not in seen:
                role = self.roles[name]
                groups.append(CollocationGroup((name,), role.total, role.per_node))
        return groups

    def group_of(self, role: str) -> CollocationGroup:
        for g in self.groups:
            if role in g.roles:
                return g
        raise KeyError(role)

    def upstream(self, role: str) -> list[str]:
        return [s for s, d in self.edges if d == role]

    def downstream(self, role: str) -> list[str]:
        return [d for s, d in self.edges if s == role]

    def depends_on(self, role: str) -> list[str]:
        """Every role downstream of ``role`` (transitively), in topological order."""
        seen: set[str] = set()
        todo = [role]
        while todo:
            for d in self.downstream(todo.pop()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return [r for r in self.order if r in seen]

    def failover_policy(self, role: str) -> str:
        """``replace`` or ``rollback`` (``roles.<role>.config.failover``; default
        ``rollback``). Raises ``SpecError`` for another value."""
        config = self.roles[role].config or {}
        return check_failover_policy(role, config.get("failover") if hasattr(config, "get")
                                     else None)

    @classmethod
    def from_spec(cls, spec: Any) -> ComputationGraph:
        """Build from a validated job spec (``DictConfig`` or ``JobSpec``)."""
        from omegaconf import OmegaConf

        roles = []
        for name, r in spec.roles.items():
            res = r.resources
            roles.append(Role(
                name=name, workload=r.workload, total=int(r.total),
                per_node=int(r.per_node or r.total), backend=r.backend or None,
                resources=Resources(float(res.cpu), float(res.gpu or 0.0), int(res.memory_mb)),
                env=tuple(sorted({**dict(spec.env), **dict(r.env)}.items())),
                config=OmegaConf.to_container(r.config) if OmegaConf.is_config(r.config)
                else dict(r.config),
            ))
        return cls(roles, [tuple(e) for e in spec.edges], [list(g) for g in spec.collocation],
                   spec.driver, int(getattr(spec, "node_num", 0) or 0))
