"""A node that replaces a lost one: the agent that starts while the job already runs with its
ranks (a new pod for a lost node, or the same agent started again without its memory) restores
their replicas from the next node's keeper into its memory and tells the controller the node was
lost (:class:`~mindft.protocol.NodeLost`, with the steps restored: the only ones those ranks can
roll back to).

Whether this agent replaces a lost node, and how its ranks start, is
:class:`~mindft.flow.agent.NodePolicy`'s to say; which node keeps whose replicas is
:class:`~mindft.flow.topology.Topology`'s. This module asks, fetches and reports.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

from mindft.agent.plan import LaunchSpec
from mindft.flow.agent import NodePolicy
from mindft.net.channel import Client, ControllerUnreachable
from mindft.protocol import JobState, JobView, NodeLost, Replaced

log = logging.getLogger(__name__)

TAKE_OVER_TIMEOUT = 2.0         # an agent other than node 0's asks once whether the job already runs
REPLICA_FETCH_TIMEOUT = 120.0   # for the agent that replaces a lost node to fetch one rank's replica


@dataclass(frozen=True)
class TakenOver:
    """This agent replaced a lost node: the job as the controller left it after the report, and
    each local rank's incarnation as the controller knew it (its ranks start as the next ones)."""

    view: JobView
    incarnations: dict[int, int]


def take_over_lost_node(spec: LaunchSpec, keys: Any, client: Client, replicating: bool,
                        say: Callable[[str], None], adoption: int = 0) -> Union[TakenOver, Replaced, None]:
    """When the job already runs with this node's ranks: restore their replicas (``replicating``:
    the node agents replicate) and report the lost node (``adoption``: the number of the spare's
    :class:`~mindft.protocol.AdoptNode`, 0 for a launcher of the node); None (nothing done) for a
    starting job; the controller's :class:`Replaced` when the node was given to a spare already."""
    try:
        status = Client(spec.controller_address, keys, timeout=TAKE_OVER_TIMEOUT).status()
    except ControllerUnreachable:
        return None  # node 0 is not up yet: the job is starting
    rows = {row.rank: row for row in status.ranks}
    local = list(spec.local_ranks)
    if not NodePolicy.replaces_lost_node(status.state, rows, local, spec.node_rank, status.nodes):
        return None
    say(f"the job already runs ({status.state}, every rank finished step {status.step}): this node replaces "
        f"node {spec.node_rank}, lost with rank(s) {local} and their snapshots")
    steps = restore_replicas(spec, keys, {rank: row.replica_endpoint for rank, row in rows.items()}, replicating, say)
    topology = spec.topology
    report = NodeLost(node=spec.node_rank, ranks=tuple(local), steps=tuple(steps[rank] for rank in local),
                      replicas_of=tuple(topology.ranks_of(topology.kept_node(spec.node_rank))),
                      reason=(f"node {spec.node_rank} given to a spare" if adoption else
                              f"a new agent for node {spec.node_rank} started without its ranks' snapshots"),
                      adoption=adoption)
    try:
        answer = client.request(report)
        if isinstance(answer, Replaced):
            return answer
        say(f"controller: {answer.detail}")
        status = client.status()
    except ControllerUnreachable as error:  # it answered, then ended the job and left
        say(f"the controller did not answer about node {spec.node_rank} ({error})")
        status = dataclasses.replace(status, state=JobState.FAILED, reason=str(error))
    return TakenOver(JobView(status.state, status.restart_all, reason=status.reason),
                     {rank: row.incarnation for rank, row in rows.items() if rank in local})


def restore_replicas(spec: LaunchSpec, keys: Any, endpoints: Mapping[int, str], replicating: bool,
                     say: Callable[[str], None]) -> dict[int, int]:
    """Fetch each local rank's replica from the next node's keeper (found among the replica
    ``endpoints`` the ranks announced) into this node's memory; rank → the step restored (-1: none)."""
    steps = {rank: -1 for rank in spec.local_ranks}
    if not replicating or spec.state_dir is None:
        say("no replica to restore: the node agents do not replicate (MINDFT_AGENT_REPLICATION=0)")
        return steps
    keeper = spec.topology.keeper_endpoint(spec.node_rank, endpoints)
    if not keeper:
        say(f"no replica to restore: the controller knows no keeper on node "
            f"{spec.topology.buddy_node(spec.node_rank)}")
        return steps
    return {rank: restore_replica(spec, keys, rank, keeper, say) for rank in spec.local_ranks}


def restore_replica(spec: LaunchSpec, keys: Any, rank: int, keeper: str, say: Callable[[str], None],
                    source: int = -1) -> int:
    """Fetch ``rank``'s replica from the keeper at ``keeper`` into this node's memory (``source``: the
    rank whose state the keeper serves instead, a data-parallel peer's); the step restored (-1: none,
    said why; the rank then starts from what its memory holds)."""
    from mindft.replica import fetch_replica
    from mindft.snapshot.store import SnapshotError, SnapshotStore

    assert spec.state_dir is not None, "replicas are restored into the node agent's memory"
    try:
        snapshot = fetch_replica(keeper, rank if source < 0 else source, keys, REPLICA_FETCH_TIMEOUT)
        with SnapshotStore(home=spec.state_dir / f"rank{rank}") as store:
            store.adopt(snapshot)
    except SnapshotError as error:
        say(f"rank {rank}: no replica restored from the keeper at {keeper}: {error}")
        return -1
    whose = f"rank {rank}'s replica" if source < 0 else f"a copy of rank {source}'s state for rank {rank}"
    say(f"restored {whose} of step {snapshot.step} from the keeper at {keeper} into this node's memory")
    return snapshot.step
