"""The dying gasp of a node agent that outlives its job: which replicas it writes, at which step,
and the manifest that says which node held what.

When the job cannot continue nothing a surviving agent holds is lost: it writes its own ranks'
state (from its memory, unless the rank wrote the same step itself) and the replicas it keeps of
ranks whose node is gone, all at one step, and a manifest beside them
(``mindft-dying-gasp-node<N>.json``, :func:`manifest`; read back by :func:`read_manifest`).

Which replicas (:func:`replicas_to_write`): when the controller itself is gone (its agent never
told this node that the job ended: the ranks gave up on it) its node went with it, node 0, and
this agent cannot tell which other node is alive: it writes every replica it keeps (a rank
whose node lives writes its own too; the same state, at worst twice). When the controller ended
the job it names the ranks it could not reach (``JobView.unreached``: lost with their node,
or gone without a process): their replicas are written.

Which step (:func:`plan`): the step the job told every rank to dump when every source holds it,
else the newest step they all hold (a replica holds one step, a rank's memory two), else none
is common and each source's newest is written; the manifest then says the steps differ.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

MANIFEST_FORMAT = "mindft-dying-gasp"
MANIFEST_VERSION = 1


def manifest_name(node: int) -> str:
    """The file name of node ``node``'s manifest in the dump directory."""
    return f"mindft-dying-gasp-node{node}.json"


class Origin(str, enum.Enum):
    """Where a rank's dying gasp came from."""

    RANK = "rank"        # the rank's own process wrote it (the step the job named)
    MEMORY = "memory"    # its node agent wrote it from its memory (the rank's snapshot slots)
    REPLICA = "replica"  # another node's agent wrote it from the replica it kept


@dataclass(frozen=True)
class Plan:
    """What one surviving agent writes: ``step`` (-1: no step is common, each source's newest),
    and for every rank it holds state of, where it comes from (MEMORY for its own ranks, REPLICA
    for the replicas it writes)."""

    step: int
    sources: Mapping[int, Origin]

    def step_of(self, rank: int, held: Sequence[int]) -> int:
        """The step written for ``rank``, whose source holds ``held``."""
        return self.step if self.step >= 0 else max(held, default=-1)


def replicas_to_write(kept: Iterable[int], orphaned: bool, unreached: Iterable[int]) -> list[int]:
    """The ranks whose replica this agent writes (of those it ``kept``): every one when
    ``orphaned`` (the controller is gone), else those the controller could not reach at the end."""
    kept = sorted(set(kept))
    if orphaned:
        return kept
    gone = set(unreached)
    return [rank for rank in kept if rank in gone]


def plan(own: Mapping[int, Sequence[int]], replicas: Mapping[int, int], wanted: int = -1) -> Plan:
    """The step to write for this node's ranks (``own``: rank → steps its memory holds) and the
    replicas it writes (``replicas``: rank → the replica's step): ``wanted`` when every source
    holds it, else the newest step common to all, else -1."""
    holdings = [frozenset(held) for held in own.values()] + [frozenset((step,)) for step in replicas.values()]
    sources = {**{rank: Origin.MEMORY for rank in own}, **{rank: Origin.REPLICA for rank in replicas}}
    if not holdings:
        return Plan(-1, sources)
    common = frozenset.intersection(*holdings)
    step = wanted if wanted in common else max(common, default=-1)
    return Plan(step, sources)


@dataclass(frozen=True)
class Entry:
    """One rank's dying gasp as the manifest records it."""

    file: str        # the .ckpt, in the manifest's directory
    step: int
    node: int        # the node that ran the rank
    written_by: int  # the node whose agent (or rank) wrote the file
    origin: Origin


def manifest(node: int, world_size: int, entries: Mapping[int, Entry], reason: str, created: float) -> dict:
    """Node ``node``'s manifest: every rank it wrote (or found written), the common step (-1 when
    the steps differ), and why the job ended."""
    steps = {entry.step for entry in entries.values()}
    return {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "node": node, "world_size": world_size,
        "step": steps.pop() if len(steps) == 1 else -1, "reason": reason, "created": created,
        "ranks": {str(rank): {"file": entry.file, "step": entry.step, "node": entry.node,
                              "written_by": entry.written_by, "origin": entry.origin.value}
                  for rank, entry in sorted(entries.items())},
    }


def read_manifest(data: Any) -> tuple[int, int, dict[int, Entry]]:
    """(step, world size, rank → entry) of a manifest's JSON; ValueError, saying what is wrong,
    for anything else (another format, an unknown version, a malformed entry)."""
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"not a {MANIFEST_FORMAT} manifest")
    if data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{MANIFEST_FORMAT} manifest version {data.get('version')!r}; this mindft reads "
                         f"version {MANIFEST_VERSION}")
    try:
        entries = {int(rank): Entry(str(row["file"]), int(row["step"]), int(row["node"]), int(row["written_by"]),
                                    Origin(row["origin"]))
                   for rank, row in data["ranks"].items()}
        return int(data["step"]), int(data["world_size"]), entries
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"malformed {MANIFEST_FORMAT} manifest: {error!r}") from None


def resume_point(manifests: Iterable[tuple[int, int, Mapping[int, Entry]]],
                 world_size: Optional[int] = None) -> tuple[int, dict[int, Entry]]:
    """The step to resume from and every rank's file, from the manifests of the surviving nodes:
    one step that every rank has a dying gasp of (the newest such when nodes wrote different
    steps). ValueError when there is none, naming the ranks missing."""
    by_step: dict[int, dict[int, Entry]] = {}
    sizes = set()
    for _, size, entries in manifests:
        sizes.add(size)
        for rank, entry in entries.items():
            by_step.setdefault(entry.step, {}).setdefault(rank, entry)
    if world_size is not None:
        sizes.add(world_size)
    if len(sizes) != 1:
        raise ValueError(f"the manifests are of jobs of different sizes: {sorted(sizes)}")
    size = sizes.pop()
    complete = [step for step, ranks in by_step.items() if set(ranks) == set(range(size))]
    if not complete:
        held = {step: sorted(ranks) for step, ranks in sorted(by_step.items())}
        raise ValueError(f"no step has a dying gasp of every rank 0..{size - 1}: steps and ranks written: {held}")
    step = max(complete)
    return step, by_step[step]
