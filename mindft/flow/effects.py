"""What the flow asks its shell to do (its inputs besides wire messages are in :mod:`mindft.flow.inputs`).

The core never performs I/O: every decision comes back as a list of these values, each with
the reason as data, and the shell (``mindft.controller``) carries them out in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from mindft.exitcodes import ExitCode
from mindft.flow.states import JobState
from mindft.protocol import RELAY_SEPARATOR, AdoptNode, Message, OrderKind, RankOrder, relay_cut

Peer = bytes  # the shell's opaque address of a rank (a ZeroMQ identity)


def broadcast_target(peer: Peer) -> Peer:
    """Where a broadcast meant for ``peer`` goes: itself, or for a rank behind a relay (a node agent
    that relays its ranks' traffic) the relay's address of all its ranks, so a broadcast crosses each
    relay's link once."""
    cut = relay_cut(peer)
    return peer if cut < 0 else peer[:cut + 1]


def relay_of(peer: Peer) -> Peer:
    """The address of every rank behind ``peer``, a relay's own link."""
    return peer + RELAY_SEPARATOR


@dataclass(frozen=True)
class Send:
    """Send ``message`` to one peer."""

    peer: Peer
    message: Message


@dataclass(frozen=True)
class Broadcast:
    """Send ``message`` to every peer in ``peers`` (the live ranks when it was decided)."""

    peers: tuple[Peer, ...]
    message: Message


@dataclass(frozen=True)
class KillRank:
    """Order the node agent that runs ``rank`` to kill its process ``pid``: it hung, did not
    leave its device in time, or every worker restarts.

    ``restart``: start it again at once (a hang); otherwise wait for :class:`StartRank`.
    ``agent``: the link of that node agent (None: no agent said it runs ``rank``).
    """

    rank: int
    pid: int
    reason: str
    restart: bool = True
    agent: Optional[Peer] = None

    def order(self) -> RankOrder:
        """The order as it travels to the agent."""
        return RankOrder(self.rank, OrderKind.KILL, self.reason, self.pid, self.restart)


@dataclass(frozen=True)
class StartRank:
    """Order the node agent that runs ``rank`` to start its process again (its device is back
    after a hot reset, or every worker restarts). ``agent`` as in :class:`KillRank`. ``pid``: the
    process that left (0: not known), which the agent may not have seen exit yet.
    ``restore_from``: the keeper whose replica of the rank the agent restores first ("": none)."""

    rank: int
    reason: str
    agent: Optional[Peer] = None
    pid: int = 0
    restore_from: str = ""
    restore_rank: int = -1  # whose state restore_from serves, when not the rank's own (an elastic job's growth)

    def order(self) -> RankOrder:
        """The order as it travels to the agent."""
        return RankOrder(self.rank, OrderKind.START, self.reason, pid=self.pid, restore_from=self.restore_from,
                         restore_rank=self.restore_rank)


@dataclass(frozen=True)
class GiveNode:
    """Give lost node ``node`` to the spare at ``spare`` (the ``adoption``-th adoption of the job):
    :class:`~mindft.protocol.AdoptNode` on the spare's link (:mod:`mindft.flow.spares`)."""

    node: int
    spare: Peer
    adoption: int
    reason: str

    def order(self) -> AdoptNode:
        """The order as it travels to the spare."""
        return AdoptNode(self.node, self.adoption, self.reason)


@dataclass(frozen=True)
class Promoted:
    """This standby took command of the job in ``term`` (:mod:`mindft.flow.standby`), and why."""

    term: int
    reason: str


@dataclass(frozen=True)
class Fence:
    """Tell the controller this one replaced, at ``address``, that the job is commanded here now in
    ``term`` (:class:`~mindft.protocol.Superseded`; :mod:`mindft.flow.standby`)."""

    address: str
    term: int


@dataclass(frozen=True)
class SlowRank:
    """Rank ``rank`` on node ``node`` (-1: not known yet) was flagged slow (``slow``) or cleared; its own
    work per step over its peers' median was ``ratio`` in the deciding window (:mod:`mindft.flow.slow`)."""

    rank: int
    node: int
    slow: bool
    ratio: float
    reason: str


@dataclass(frozen=True)
class Resize:
    """The job goes on with the nodes ``members`` (present numbers, in their new order; ``nproc`` ranks
    each) in ``term``; ``lost``: the nodes it leaves behind (:mod:`mindft.flow.elastic`). The shell
    carries on with :func:`mindft.flow.elastic.successor`, the job of the new world."""

    members: tuple[int, ...]
    nproc: int
    term: int
    lost: tuple[int, ...]
    reason: str
    joins: tuple[Peer, ...] = ()  # spares the job grows by: nodes len(members), len(members) + 1, ...

    @property
    def nnodes(self) -> int:
        return len(self.members) + len(self.joins)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc


@dataclass(frozen=True)
class Transition:
    """The job moved from ``source`` to ``target`` (for logs and timelines)."""

    source: JobState
    target: JobState
    reason: str


@dataclass(frozen=True)
class Finish:
    """The job is over: the controller exits with ``exit_code``; ``dump_step`` is the step every
    rank dumps when it failed (-1: each its newest), which node agents use for ranks that have
    no process."""

    exit_code: ExitCode
    reason: str
    dump_step: int = -1


Effect = Union[Send, Broadcast, KillRank, StartRank, GiveNode, Promoted, Fence, SlowRank, Resize, Transition, Finish]
