"""Which step a flash load restores, decided alike on every rank. Imports no torch.

Every rank lists what it could restore and the ranks gather the lists (``all_gather_object``
with a process group, else the gather board, :mod:`.agreement`); :func:`plan` then
decides from the gathered lists alone, so every rank decides the same:

- a save in memory is a ``(step, tag)`` pair: a complete save of ``step`` made by the
  attempt (incarnation) whose :func:`.lineage.attempt_tag` is ``tag`` (read from the
  trailer of its meta block). It is a candidate only when **every** rank holds the same
  pair (its own buffer or a replica; or every saved rank's buffer of another world size
  on this node) and the pair belongs to the **current lineage** of rank 0's view of the
  directory (:func:`in_lineage`): the lineage's own attempt, or a step not above the step
  it restored. A directory without ``lineage.json`` (a fresh one, or one moved aside by
  ``submit --fresh``) has no lineage, so no buffer belongs to it: a buffer some earlier
  run left behind is never restored into a new history;
- the disk steps are rank 0's listing of the committed steps of the lineage, so ranks
  never choose from listings taken at different moments (a commit landing between two
  ranks' listings);
- a requested step (``load(step=N)``) that is neither a common candidate in memory nor a
  committed step of the lineage raises :class:`CheckpointLoadError`: a load never
  answers "nothing" for a step that exists nowhere, which would make the job start
  from 0 and re-base the lineage on its next save.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dlrover_core.checkpoint.manifest import CheckpointLoadError
from dlrover_plugin_flashckpt.lineage import attempt_tag, meta_attempt

#: the tag of a save whose meta block names no attempt (an older saver)
UNTAGGED = ""


def buffer_tag(meta: bytes) -> str:
    """The attempt tag of a save from its meta block (``""`` when it names none)."""
    att = meta_attempt(meta)
    return UNTAGGED if att is None else attempt_tag(att)


def in_lineage(lineage: dict | None, step: int, tag: str) -> bool:
    """Whether the save ``(step, tag)`` belongs to ``lineage`` (the contents of
    ``lineage.json``; ``None``: the directory has no lineage, so nothing belongs)."""
    if lineage is None:
        return False
    if tag != UNTAGGED and tag == attempt_tag(lineage.get("attempt") or {}):
        return True
    base = lineage.get("base")
    return base is not None and step <= int(base)


@dataclass
class Held:
    """What one rank can restore, as it travels in the gather.

    Attributes:
        mem: ``(step, tag)`` of its complete saves in memory (own buffers, replicas).
        other: ``(step, tag)`` of complete saves of another world size on its node.
        world: that other world size (0: none).
        disk: committed steps of the lineage, oldest first (only rank 0's is used).
        lineage: ``lineage.json`` as this rank read it (only rank 0's is used).
    """

    mem: list[tuple[int, str]] = field(default_factory=list)
    other: list[tuple[int, str]] = field(default_factory=list)
    world: int = 0
    disk: list[int] = field(default_factory=list)
    lineage: dict | None = None

    def to_wire(self) -> dict:
        return {"mem": [list(p) for p in self.mem], "other": [list(p) for p in self.other],
                "world": self.world, "disk": list(self.disk), "lineage": self.lineage}

    @classmethod
    def from_wire(cls, d: dict) -> Held:
        return cls([(int(s), str(t)) for s, t in d["mem"]],
                   [(int(s), str(t)) for s, t in d["other"]], int(d["world"]),
                   [int(s) for s in d["disk"]], d["lineage"])


@dataclass
class Plan:
    """What to try, in order. ``memory``: ``(step, tag, "own")`` (this rank's own
    buffer or a replica of it) or ``(step, tag, "other")`` (resharded from another
    world size's buffers on the node), or ``None``. ``disk``: committed steps, newest
    first. ``lineage``: the lineage the plan was made against (rank 0's)."""

    memory: tuple[int, str, str] | None
    disk: list[int]
    lineage: dict | None
    #: steps every rank holds in memory that the lineage does not take (newest first)
    refused: list[int] = field(default_factory=list)


def plan(held: list[Held], world_size: int, step: int | None, directory: str) -> Plan:
    """Decide from every rank's :class:`Held` (rank order) what to load.

    Raises:
        CheckpointLoadError: ``held`` is not every rank's (the ranks could not gather:
            choosing alone could mix steps), or ``step`` was asked for and is neither
            held in memory by every rank nor committed in the current lineage.
    """
    if len(held) != world_size:
        raise CheckpointLoadError(directory, {
            -1 if step is None else step:
            f"only {len(held)} of {world_size} ranks took part in choosing the step (the "
            "gather timed out or failed: see the warning above); loading alone could "
            "restore different steps on different ranks. Every rank must call load()"})
    first = held[0]
    lineage, disk = first.lineage, list(first.disk)
    own = set(first.mem).intersection(*(set(h.mem) for h in held[1:]))
    other: set[tuple[int, str]] = set()
    if len({h.world for h in held}) == 1 and first.world:
        other = set(first.other).intersection(*(set(h.other) for h in held[1:]))
    current = attempt_tag((lineage or {}).get("attempt") or {}) if lineage else None
    cands = [(s, t, "own") for s, t in own if in_lineage(lineage, s, t)] + \
            [(s, t, "other") for s, t in other if in_lineage(lineage, s, t)]
    refused = sorted({s for s, t in own | other if not in_lineage(lineage, s, t)},
                     reverse=True)
    # newest step first; at one step the lineage's own attempt first, own buffers first
    cands.sort(key=lambda c: (c[0], c[1] == current, c[2] == "own"), reverse=True)
    if step is not None:
        cands = [c for c in cands if c[0] == step]
        disk = [step] if step in disk else []
        if not cands and not disk:
            have = sorted(first.disk)
            raise CheckpointLoadError(directory, {step: (
                f"step {step} is not committed in the current lineage (committed: "
                f"{', '.join(map(str, have)) or 'none'}) and not held in memory by every "
                "rank; nothing was loaded and the lineage is unchanged")})
        return Plan(cands[0] if cands else None, disk, lineage,
                    [s for s in refused if s == step])
    memory = cands[0] if cands else None
    if memory is not None and disk and disk[-1] > memory[0]:
        memory = None
    newest = max([memory[0] if memory else -1] + disk[-1:])
    return Plan(memory, sorted(disk, reverse=True), lineage,
                [s for s in refused if s > newest])
