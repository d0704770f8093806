"""A controller started again (node 0 lost with it, its pod back) finds the job under way.

The new controller starts knowing nothing. What survived says where the job is: a rank that
reconnects registers with the step it got to (:attr:`~mindft.protocol.Register.progress`), and
every node agent's hello says which processes it runs, what its memory holds of its ranks and
which replicas its keeper holds of other nodes' ranks (:class:`~mindft.protocol.AgentHello`).
:class:`Survivors` gathers this while the job is STARTING; once it shows the job under way and
every rank's agent has spoken, the job restarts every worker from the agents' memory, the ranks
whose agent holds nothing (those of the lost node) from their replica on the next node, and
rolls back (:func:`mindft.flow.lost.rejoin`). A fresh job shows nothing of the kind and
starts as always.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from mindft.protocol import AgentHello


@dataclass(frozen=True)
class AgentSaid:
    """What a rank's node agent said of it: its process (pid 0: none) and that process's
    incarnation, and the newest step of its snapshots in the agent's memory (-1: none)."""

    node: int
    pid: int
    incarnation: int
    newest: int


@dataclass(frozen=True)
class Replica:
    """A replica a keeper holds of another node's rank."""

    keeper: str
    step: int
    node: int  # the keeper's
    rank: int = -1  # whose state it is, when not the rank's own: a data-parallel peer's copy


class Survivors:
    """What the ranks and node agents report of a job the controller may have lost (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.agents: dict[int, AgentSaid] = {}
        self.replicas: dict[int, Replica] = {}
        self.progress: dict[int, int] = {}  # rank → the step it said it got to when it registered (-1: a new process)
        self.keepers: dict[int, str] = {}  # node → its agent's keeper
        self.joining = world_size  # the first rank of the nodes an elastic job grows by (none: the world size)
        # How many ranks said they got past the start, and how many agents' memories hold a snapshot: kept
        # with each report, so that ``under_way``, read at every registration, costs O(1), not O(ranks).
        self._past_start = 0
        self._in_memory = 0

    def hello(self, message: AgentHello) -> None:
        """A node agent's hello; one without ``pids`` says nothing yet (its ranks are not started)."""
        if not message.pids:
            return
        for index, rank in enumerate(message.ranks):
            if 0 <= rank < self.world_size:
                said = AgentSaid(message.node, _at(message.pids, index, 0), _at(message.incarnations, index, 0),
                                 _at(message.newest, index, -1))
                before = self.agents.get(rank)
                self._in_memory += (said.newest >= 0) - (before is not None and before.newest >= 0)
                self.agents[rank] = said
        if message.keeper:
            self.keepers[message.node] = message.keeper
            for rank, step in zip(message.kept, message.kept_steps):
                held = self.replicas.get(rank)
                if 0 <= rank < self.world_size and (held is None or step > held.step):
                    self.replicas[rank] = Replica(message.keeper, step, message.node)

    def registered(self, rank: int, progress: int) -> None:
        self._past_start += (progress >= 0) - (self.progress.get(rank, -1) >= 0)
        self.progress[rank] = progress

    def exited(self, rank: int) -> None:
        """Its agent reported its process gone: there is nothing of it to kill."""
        said = self.agents.get(rank)
        if said is not None:
            self.agents[rank] = replace(said, pid=0)

    @property
    def under_way(self) -> bool:
        """The job started before this controller: a rank that reconnects was past the start
        barrier, or an agent's memory or keeper holds a snapshot (a rank takes its first, of step 0,
        once past the barrier)."""
        return self._past_start > 0 or bool(self.replicas) or self._in_memory > 0

    def unheard(self) -> list[int]:
        """Ranks whose node agent has not said hello yet."""
        return [r for r in range(self.world_size) if r not in self.agents]

    def lost(self) -> dict[int, Optional[Replica]]:
        """The ranks whose state is gone from their node (its agent holds none and their process
        got nowhere: a new node), each with the replica it can start from (None: none kept)."""
        return {rank: self.replicas.get(rank) or (self.copy() if rank >= self.joining else None)
                for rank, said in sorted(self.agents.items()) if said.newest < 0 and self.progress.get(rank, -1) < 0}

    def copy(self) -> Optional[Replica]:
        """For a rank of a node the job grows by: a data-parallel peer's state, served by the keeper of
        that peer's node: the peer whose memory's newest snapshot is the oldest, which every other rank
        still holds (ranks in lockstep are at most a step apart, and each keeps two)."""
        peers = [(said.newest, rank, said.node) for rank, said in self.agents.items()
                 if rank < self.joining and said.newest >= 0 and said.node in self.keepers]
        if not peers:
            return None
        step, rank, node = min(peers)
        return Replica(self.keepers[node], step, node, rank)


def _at(values: tuple[int, ...], index: int, default: int) -> int:
    return values[index] if index < len(values) else default
