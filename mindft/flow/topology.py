"""Who keeps whose replica: the job's buddy topology, the one place it is computed.

``mindft-launch`` lays the ranks out node by node: node ``n`` runs ranks ``n * nproc`` to
``(n + 1) * nproc - 1``. On several nodes the replicas go round a ring of nodes, so that the
loss of one node leaves its ranks' state on the next one:

- the node agents replicate (``MINDFT_AGENT_REPLICATION=1``): node ``n``'s agent sends its
  ranks' snapshots to the keeper of node ``n + 1`` (:meth:`Topology.buddy_node`) and keeps those
  of node ``n - 1`` (:meth:`Topology.kept_node`); the agent that replaces a lost node fetches its
  ranks' replicas back from the next node's keeper (:meth:`Topology.keeper_endpoint`);
- the ranks replicate (``MINDFT_AGENT_REPLICATION=0``): a rank's buddy is the same local rank on
  the next node (:meth:`Topology.buddy_rank`), which ``mindft-launch`` passes as
  ``MINDFT_REPLICA_BUDDY``;
- a rank started without ``mindft-launch`` knows no nodes: its buddy is ``MINDFT_REPLICA_BUDDY``
  or else the next rank (:func:`rank_buddy`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

REPLICA_TRANSPORT = "tcp://"  # a keeper's announced endpoint: other endpoints (none yet) are not reachable


@dataclass(frozen=True)
class Topology:
    """``nnodes`` nodes of ``nproc`` ranks each, laid out node by node."""

    nproc: int
    nnodes: int

    @property
    def world_size(self) -> int:
        """Ranks in the job, over every node."""
        return self.nproc * self.nnodes

    def node_of(self, rank: int) -> int:
        """The node that runs ``rank``."""
        return rank // self.nproc

    def ranks_of(self, node: int) -> range:
        """The global ranks ``node`` runs."""
        return range(node * self.nproc, (node + 1) * self.nproc)

    def buddy_node(self, node: int) -> int:
        """The node whose agent keeps ``node``'s replicas: the next one, round the ring."""
        return (node + 1) % self.nnodes

    def kept_node(self, node: int) -> int:
        """The node whose replicas ``node``'s agent keeps: the previous one, round the ring."""
        return (node - 1) % self.nnodes

    def buddy_rank(self, rank: int) -> Optional[int]:
        """The rank whose process keeps ``rank``'s replica when the ranks replicate: the same local
        rank on the next node; None on one node, where the node agent's memory holds the state (a
        copy on the same node guards against nothing more, and costs every step)."""
        if self.nnodes < 2:
            return None
        return (rank + self.nproc) % self.world_size

    def keeper_endpoint(self, node: int, endpoints: Mapping[int, str]) -> str:
        """Where the keeper of ``node``'s replicas listens, from the replica endpoints the ranks
        announced (rank → endpoint, as the controller's status lists them): the first one of a rank
        on :meth:`buddy_node`; "" while none is known."""
        buddy = self.buddy_node(node)
        return next((endpoint for rank, endpoint in sorted(endpoints.items())
                     if self.node_of(rank) == buddy and endpoint.startswith(REPLICA_TRANSPORT)), "")


def rank_buddy(rank: int, world_size: int, configured: Optional[int]) -> Optional[int]:
    """The rank whose process keeps ``rank``'s replica when the ranks replicate themselves:
    ``configured`` (``MINDFT_REPLICA_BUDDY``, which ``mindft-launch`` sets from
    :meth:`Topology.buddy_rank`), else the next rank; None when there is none: alone, or
    ``configured`` is -1 (the node agent holds the state)."""
    if world_size == 1 or configured == -1:
        return None
    return (rank + 1) % world_size if configured is None else configured
