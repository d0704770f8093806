"""The node's state in memory, from the start of the job to its end: the shared memory its
ranks' snapshots live in (``state_dir/rank<R>``, which outlives their processes), the replication
that sends them to the next node and keeps the previous node's, the dying-gasp checkpoints the
agent writes from that memory when the job cannot continue, and the memory's removal at the end.

Which ranks get a dying gasp from memory, at which step and why, is
:class:`~mindft.flow.agent.NodePolicy`'s to say; what the gasp holds, :mod:`mindft.flow.gasp`'s;
writing it, :mod:`mindft.agent.gasp`'s.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import psutil

from mindft.agent.plan import LaunchSpec, rank_environment
from mindft.config import load_config
from mindft.flow.agent import NodePolicy
from mindft.observe.units import size_text

log = logging.getLogger(__name__)


MEMORY_PREFIX = "mindft-state-"  # a node agent's shared memory: its ranks' snapshots, the replicas it keeps
KEY_PREFIX = "mindft-key-"  # the job key a launcher generated (never in the run directory)
OWNER_FILE = "owner.json"  # which launcher holds the directory: its pid and when that process started


def _memory_base() -> Path:
    base = Path("/dev/shm")
    return base if base.is_dir() else Path(tempfile.gettempdir())


def private_memory(prefix: str) -> Path:
    """A fresh directory (mode 700) in memory (/dev/shm, where it exists), marked as this launcher's:
    removed at its end, or by the next launcher on the host once this one is gone
    (:func:`remove_stale_memory`)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=_memory_base()))
    owner = {"pid": os.getpid(), "started": psutil.Process().create_time()}
    (directory / OWNER_FILE).write_text(json.dumps(owner))
    return directory


def agent_memory() -> Path:
    """A fresh directory for the ranks' snapshots (:func:`private_memory`)."""
    return private_memory(MEMORY_PREFIX)


def stale_memory() -> list[Path]:
    """This user's memory directories (snapshots, generated keys) of launchers on this host that are
    gone (killed, or their node lost and the pod's container restarted: /dev/shm survives both). A
    directory that names no owner is left out."""
    stale: list[Path] = []
    for directory in sorted(_memory_base().glob("mindft-*-*")):
        if not directory.name.startswith((MEMORY_PREFIX, KEY_PREFIX)) or not directory.is_dir():
            continue
        try:
            if directory.stat().st_uid != os.getuid():
                continue
            owner = json.loads((directory / OWNER_FILE).read_text())
            pid, started = int(owner["pid"]), float(owner["started"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _running(pid, started):
            stale.append(directory)
    return stale


def remove_stale_memory() -> list[tuple[Path, int]]:
    """Remove the :func:`stale_memory` directories; each with the bytes it held."""
    removed: list[tuple[Path, int]] = []
    for directory in stale_memory():
        size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        shutil.rmtree(directory, ignore_errors=True)
        removed.append((directory, size))
    return removed


def _running(pid: int, started: float) -> bool:
    """Whether process ``pid`` that started at ``started`` still runs (not another process given its pid)."""
    try:
        return abs(psutil.Process(pid).create_time() - started) < 1.0
    except psutil.Error:
        return False


def agent_memory_report(state_dir: Path) -> str:
    """One line: the shared memory the ranks' snapshots took in the node agent (two slots each)."""
    sizes = {}
    for rank_dir in sorted(state_dir.glob("rank*")):
        sizes[rank_dir.name] = sum(f.stat().st_size for f in rank_dir.rglob("*") if f.is_file())
    if not sizes:
        return f"the node agent held no snapshots ({state_dir})"
    return (f"the node agent held {size_text(sum(sizes.values()))} of snapshots for {len(sizes)} rank(s) "
            f"(largest {size_text(max(sizes.values()))}: two slots of the rank's state)")


def start_replication(spec: LaunchSpec, keys: Any) -> Optional[Any]:
    """This node agent's replica keeper and sender (a :class:`mindft.replica.NodeReplication`) when
    the job needs them: several nodes, mindft's own backend, MINDFT_AGENT_REPLICATION not 0; else None."""
    if not spec.protected or spec.mindio or spec.nnodes < 2 or spec.state_dir is None:
        return None
    config = load_config(spec.env)
    if not config.agent_replication:
        return None
    from mindft.replica import NodeReplication, replica_spill

    return NodeReplication(spec.state_dir, spec.local_ranks, spec.nproc, spec.nnodes, spec.node_rank,
                           spec.master_ip, spec.controller_address, keys,
                           spill=replica_spill(config.dump_dir, f"node{spec.node_rank}"))


def dump_ranks_without_process(spec: LaunchSpec, policy: NodePolicy, step: int,
                               say: Callable[[str], None]) -> list[int]:
    """The job failed while ranks had no process (off their devices for a hot reset that failed,
    or stopped so every worker restarts): their snapshots are in this agent's memory, so the
    agent writes their dying-gasp checkpoints of ``step``; the ranks it wrote."""
    from mindft.agent.gasp import dump_from_memory

    written: list[int] = []
    if spec.state_dir is None:
        return written
    for rank in policy.without_process():
        config = load_config(rank_environment(spec, rank, policy.workers[rank].restarts))
        ok = dump_from_memory(spec.state_dir, config.dump_dir, rank, config.world_size, step, say)
        policy.dumped(rank, ok=ok)
        if ok:
            written.append(rank)
    return written


def write_node_gasp(spec: LaunchSpec, policy: NodePolicy, replication: Optional[Any], keys: Any, step: int,
                    reason: str, from_memory: list[int], say: Callable[[str], None]) -> None:
    """Every rank's state this node holds, at ``step``: its own ranks' and the replicas it keeps
    of ranks whose node is gone, with the manifest (before the keeper and the memory go)."""
    from mindft.agent.gasp import write_dying_gasp

    if spec.state_dir is None or spec.mindio:
        return
    view = policy.view
    write_dying_gasp(node=spec.node_rank, nproc=spec.nproc, world_size=spec.world_size, state_dir=spec.state_dir,
                     dump_dir=load_config(spec.env).dump_dir, own_ranks=spec.local_ranks,
                     keeper_endpoint=replication.endpoint if replication else None,
                     kept=replication.keeper.held if replication else {}, keys=keys,
                     orphaned=policy.orphaned, unreached=view.unreached if view is not None else (),
                     wanted=step, say=say, reason=reason, from_memory=from_memory)


def release_memory(spec: LaunchSpec, replication: Optional[Any], say: Callable[[str], None]) -> None:
    """At the end: stop replicating, say what was sent, held and taken, and remove the memory."""
    if replication is not None:
        replication.close()
        say(replication.summary())
    if spec.state_dir is not None:
        say(agent_memory_report(spec.state_dir))
        shutil.rmtree(spec.state_dir, ignore_errors=True)
