"""Warm spare nodes: a node lost for good is given to a spare at once.

A spare is a node agent started with ``mindft-launch --spare``: its warm process ready, no ranks.
It says hello to the controller like every node agent (:class:`~mindft.protocol.AgentHello`,
``spare``) and waits. The controller hears each node agent's hello every :data:`HELLO_INTERVAL`;
a node whose agent and ranks have all been silent for :func:`silent_after` while the job trains
or recovers is lost as far as the job can tell. With a spare there, the job gives it the node
(:class:`~mindft.protocol.AdoptNode`): the spare becomes that node's agent, restores the node's
ranks' replicas from the next node's keeper and reports the node lost
(:class:`~mindft.protocol.NodeLost` with the adoption's number), exactly as a launcher started
again for the node would (:mod:`mindft.agent.takeover`); the ladder does the rest
(:func:`mindft.flow.lost.node_lost`). Without a spare nothing changes: the job waits for the
node's own launcher, up to ``timeouts.repair``.

A node given away stays given: an agent that speaks for it afterwards (the lost node back, a
launcher started again for it, an agent that was only cut off) is answered
:class:`~mindft.protocol.Replaced`, and its report of the node lost is refused unless it carries
the adoption's number. It stops what it runs and waits as a spare itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from mindft.protocol import JobState, NodeLost

HELLO_INTERVAL = 2.0  # between a node agent's hellos on its link to the controller
_SILENT_HELLOS = 3  # hellos a node agent may miss before its node counts as lost


def silent_after(dead_after: float) -> float:
    """Seconds a node's agent and every one of its ranks must be silent before its node counts as lost:
    a few missed hellos, and never less than a rank's own ``dead_after``."""
    return max(dead_after, _SILENT_HELLOS * HELLO_INTERVAL)


@dataclass
class NodeSeen:
    """A node agent as the controller hears it: its link (``peer``), its ranks, its last hello, and
    where its node's standby controller would listen (``address``)."""

    peer: bytes
    ranks: tuple[int, ...]
    last_seen: float
    address: str = ""


@dataclass(frozen=True)
class Adoption:
    """Lost node ``node`` given to the spare at ``peer``: the ``number``-th adoption of the job."""

    node: int
    peer: bytes
    number: int
    reason: str


@dataclass
class Spares:
    """The job's warm spares and the nodes given to them (see the module docstring).

    ``local``: the link of the node agent in the controller's own process, which says hello once
    and is never silent to it (its node is the controller's)."""

    dead_after: float
    local: bytes = b""
    waiting: dict[bytes, float] = field(default_factory=dict)  # a spare's link → its last hello
    nodes: dict[int, NodeSeen] = field(default_factory=dict)
    given: dict[int, Adoption] = field(default_factory=dict)  # node → the adoption that gave it away
    adoptions: list[Adoption] = field(default_factory=list)
    back: dict[bytes, float] = field(default_factory=dict)  # a spare heard again after a silence → since when

    @property
    def silent_after(self) -> float:
        return silent_after(self.dead_after)

    def hello(self, peer: bytes, node: int, ranks: Sequence[int], spare: bool, now: float,
              address: str = "") -> Optional[Adoption]:
        """A node agent's hello; the adoption that gave its node to another agent (it is to be
        answered :class:`~mindft.protocol.Replaced`), or None."""
        if spare:
            last = self.waiting.get(peer)
            if last is not None and now - last > self.silent_after:
                # Silent that long, then heard: its hellos may be ones a partition held back and its
                # healing delivered at once, sent before it followed another controller. It counts
                # as a spare again once heard a while later.
                self.back[peer] = now
            elif peer in self.back and now - self.back[peer] >= HELLO_INTERVAL / 2:
                del self.back[peer]
            self.waiting[peer] = now
            return None
        given = self.given.get(node)
        if given is not None and given.peer != peer:
            return given
        self.waiting.pop(peer, None)  # a spare that adopted this node speaks for it now
        self.nodes[node] = NodeSeen(peer, tuple(ranks), now, address)
        return None

    def live_spares(self, now: float) -> list[bytes]:
        """The spares heard from lately, longest waiting first."""
        return [peer for peer, seen in self.waiting.items() if now - seen <= self.silent_after and peer not in self.back]

    def lost_nodes(self, now: float, rank_heard: dict[int, float]) -> list[int]:
        """Nodes whose agent and ranks have all been silent for :attr:`silent_after` (``rank_heard``:
        rank → when the job last heard it)."""
        limit = self.silent_after
        return [node for node, seen in sorted(self.nodes.items())
                if seen.peer != self.local and now - seen.last_seen > limit
                and all(now - rank_heard.get(rank, seen.last_seen) > limit for rank in seen.ranks)]

    def adopt(self, state: JobState, now: float, rank_heard: dict[int, float], grace: float) -> list[Adoption]:
        """Give every lost node to a live spare while the job trains or recovers; the adoptions made.
        A node just given away counts as heard until ``grace`` has passed (its new agent fetches the
        replicas before it says hello as that node)."""
        if state in (JobState.STARTING, JobState.DONE, JobState.FAILED):
            return []
        lost = self.lost_nodes(now, rank_heard)
        return self._give({node: self.nodes[node].ranks for node in lost}, now, grace, {
            node: (f"node {node}'s agent and ranks {list(self.nodes[node].ranks)} silent for "
                   f"{now - self.nodes[node].last_seen:.1f} s (> {self.silent_after:g} s)") for node in lost})

    def give(self, nodes: Sequence[int], ranks: dict[int, tuple[int, ...]], now: float,
             grace: float) -> list[Adoption]:
        """A controller that rebuilds the job (:mod:`mindft.flow.standby`) heard no agent of ``nodes``
        (``ranks``: each one's ranks): give each, not given already, to a live spare; the adoptions made."""
        wanted = {node: ranks[node] for node in nodes if node not in self.given}
        return self._give(wanted, now, grace, {node: f"no agent of node {node} spoke to the controller that "
                                                     f"rebuilds the job" for node in wanted})

    def _give(self, nodes: dict[int, tuple[int, ...]], now: float, grace: float,
              reasons: dict[int, str]) -> list[Adoption]:
        made: list[Adoption] = []
        spares = self.live_spares(now)
        for node, ranks in sorted(nodes.items()):
            if not spares:
                break
            peer = spares.pop(0)
            del self.waiting[peer]
            adoption = Adoption(node, peer, len(self.adoptions) + 1, reasons[node])
            self.adoptions.append(adoption)
            self.given[node] = adoption
            self.nodes[node] = NodeSeen(peer, ranks, now + grace)
            made.append(adoption)
        return made

    def replace_slow(self, node: int, now: float, grace: float, reason: str) -> Optional[Adoption]:
        """A node flagged slow (:mod:`mindft.flow.slow`, MINDFT_SLOW_ACTION=spare) is given to the
        longest-waiting live spare as a lost one is; its agent is to be answered
        :class:`~mindft.protocol.Replaced` (it stops its ranks and waits as a spare). Not node 0's agent,
        which runs the controller, nor a node given away already; None when no spare is there."""
        seen = self.nodes.get(node)
        if seen is None or seen.peer == self.local or node in self.given or not self.live_spares(now):
            return None
        (adoption,) = self._give({node: seen.ranks}, now, grace, {node: reason})
        return adoption

    def refuses(self, message: NodeLost) -> Optional[Adoption]:
        """The adoption that gave ``message``'s node to another agent, if the report is not that
        adoption's own (a launcher for the node, started after it was given away); else None."""
        given = self.given.get(message.node)
        return given if given is not None and message.adoption != given.number else None


def given_away(node: int, adoption: int, reason: str) -> str:
    """What an agent whose node was given to a spare is told (:class:`~mindft.protocol.Replaced`)."""
    return (f"node {node} was given to a spare (adoption {adoption}: {reason}); this agent runs nothing of "
            f"the job and waits as a spare")
