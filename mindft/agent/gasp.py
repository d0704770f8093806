"""A node agent's dying gasp when the job cannot continue: its own ranks' state and the replicas
it keeps of ranks whose node is gone, written at one step, with the manifest that says which
node held what (the rules: :mod:`mindft.flow.gasp`)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

from mindft.snapshot.ckpt import atomic_write
from mindft.flow import gasp
from mindft.flow.gasp import Entry, Origin
from mindft.flow.topology import Topology

log = logging.getLogger(__name__)

FETCH_TIMEOUT = 30.0  # s for this agent's own keeper to hand over a replica


def dump_name(rank: int, step: int) -> str:
    """The dying gasp's file name, as :meth:`mindft.snapshot.store.SnapshotStore.dump` writes it."""
    return f"mindft-rank{rank}-step{step}.ckpt"


def dump_from_memory(state_dir: Path, dump_dir: Path, rank: int, world_size: int, step: int,
                     say: Callable[[str], None]) -> bool:
    """A rank without a process: its dying gasp of ``step`` from this agent's memory; True when written."""
    from mindft.snapshot.store import SnapshotError, SnapshotStore

    try:
        with SnapshotStore(home=state_dir / f"rank{rank}", resume=True) as store:
            path = store.dump(dump_dir, rank, world_size, step)
    except SnapshotError as error:
        say(f"rank {rank} had no process; its dying-gasp checkpoint could NOT be written from the agent's "
            f"memory: {error}")
        return False
    say(f"rank {rank} had no process; the agent wrote its dying-gasp checkpoint from memory: {path}")
    return True


def write_dying_gasp(*, node: int, nproc: int, world_size: int, state_dir: Path, dump_dir: Path,
                     own_ranks: Iterable[int], keeper_endpoint: Optional[str], kept: Mapping[int, int],
                     keys: Any, orphaned: bool, unreached: Iterable[int], wanted: int, reason: str,
                     say: Callable[[str], None], from_memory: Iterable[int] = ()) -> Optional[Path]:
    """Write what this node holds at one step (:func:`mindft.flow.gasp.plan`) and its manifest;
    returns the manifest's path (None: nothing held). ``kept``: rank → step of the replicas this
    node's keeper holds (at ``keeper_endpoint``); ``wanted``: the step the job told every rank to
    dump (-1: none); ``from_memory``: the ranks this agent already wrote from its memory (they had no
    process). Every failure is said and leaves that rank out of the manifest."""
    from mindft.replica import fetch_replica
    from mindft.snapshot.store import SnapshotError, SnapshotStore

    own: dict[int, tuple[int, ...]] = {}
    for rank in own_ranks:
        try:
            with SnapshotStore(home=state_dir / f"rank{rank}", resume=True) as store:
                own[rank] = store.steps
        except SnapshotError as error:
            say(f"rank {rank}: its snapshots in this node's memory cannot be read: {error}")
    replicas = {rank: kept[rank] for rank in gasp.replicas_to_write(kept, orphaned, unreached)}
    topology = Topology(nproc, world_size // nproc)  # where the ranks whose replicas this node kept ran
    if not own and not replicas:
        return None
    plan = gasp.plan(own, replicas, wanted)
    entries: dict[int, Entry] = {}
    for rank, held in own.items():
        step = plan.step_of(rank, held)
        if step < 0:
            continue
        path = dump_dir / dump_name(rank, step)
        origin = Origin.MEMORY if rank in set(from_memory) else Origin.RANK
        if not (path.exists() and path.with_suffix(".json").exists()):
            origin = Origin.MEMORY
            try:
                with SnapshotStore(home=state_dir / f"rank{rank}", resume=True) as store:
                    path = store.dump(dump_dir, rank, world_size, step)
            except SnapshotError as error:
                say(f"rank {rank}: its dying gasp of step {step} could NOT be written from memory: {error}")
                continue
        entries[rank] = Entry(path.name, step, node, node, origin)
    for rank, step in replicas.items():
        if plan.step >= 0 and step != plan.step:
            continue  # not reached: the plan's step is common to every source
        try:
            snapshot = fetch_replica(keeper_endpoint or "", rank, keys, FETCH_TIMEOUT)
            with SnapshotStore() as store:
                store.adopt(snapshot)
                path = store.dump(dump_dir, rank, world_size, snapshot.step)
        except SnapshotError as error:
            say(f"rank {rank}: the replica this node kept (step {step}) could NOT be written: {error}")
            continue
        entries[rank] = Entry(path.name, snapshot.step, topology.node_of(rank), node, Origin.REPLICA)
        say(f"rank {rank}'s node is gone: wrote the replica this node kept, step {snapshot.step}, as its "
            f"dying gasp: {path}")
    if not entries:
        return None
    document = gasp.manifest(node, world_size, entries, reason, time.time())
    target = dump_dir / gasp.manifest_name(node)
    try:
        atomic_write(target, lambda handle: handle.write(json.dumps(document, indent=1).encode()))
    except OSError as error:
        say(f"the dying gasp's manifest could NOT be written to {target}: {error}")
        return None
    held = ", ".join(f"rank {rank} ({entry.origin.value}, step {entry.step})"
                     for rank, entry in sorted(entries.items()))
    say(f"dying gasp of this node: {held}; manifest {target}")
    return target
