"""Standby controllers: the job's controller runs on node 0 and stands by on the next nodes.

With ``mindft-launch --standbys N`` (1 or 2; MindIO TFT keeps up to two backup controllers too)
nodes 1..N are the controller's candidates, in that order. Each says where its controller would
listen in its agent's hello; the active controller tells every node agent where the candidates
are (:attr:`~mindft.protocol.JobView.standbys`) and its term.

A node agent whose controller has been silent for :func:`takeover_after` moves its link to the
next candidate (:class:`Failover`). The agent of that candidate's node starts a controller there,
with the next term, *standing by*: it answers and gathers what the survivors say
(:mod:`mindft.flow.rejoin`) but commands nothing until at least half of the job's node agents
have said hello to it (:func:`promotes`, as MindIO's ``IsBackupToMaster()`` waits for half of the
world). Then it rebuilds the job as a controller started again does: the nodes no agent speaks
for are given to warm spares (:mod:`mindft.flow.spares`), and every worker restarts from the
agents' memory, the lost node's ranks from their replicas, behind a new MindSpore scheduler on
the new controller's node.

Every view, order and adoption carries the controller's term; an agent refuses those of an
older term than it knows, so a controller that comes back after a takeover cannot command the
agents that followed the new one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from mindft.flow.effects import Promoted, Send
from mindft.protocol import JobView, Replaced, Superseded

log = logging.getLogger(__name__)

MAX_STANDBYS = 2


def takeover_after(dead_after: float, connect_retries: int) -> float:
    """Seconds the active controller must be silent before a node agent moves to the next candidate:
    half of a rank's own patience with a silent controller (``dead_after`` × ``connect_retries``),
    so that the standby rebuilds the job before the ranks give up on their controller."""
    return dead_after * max(2, connect_retries // 2)


def rank_retries(connect_retries: int, standbys: int) -> int:
    """Silent periods a rank waits for its controller before it gives up (its dying gasp): twice as
    many when standbys run, so that a standby takes over (:func:`takeover_after`) and rebuilds the job,
    which restarts the rank, well within its patience."""
    return connect_retries * (2 if standbys else 1)


def candidates(standbys: int, node: int) -> tuple[int, ...]:
    """The nodes that stand by for a controller on ``node``, in takeover order: of nodes 1..``standbys``,
    those after it."""
    return tuple(n for n in range(1, min(standbys, MAX_STANDBYS) + 1) if n > node)


def promotes(heard_nodes: int, nnodes: int) -> bool:
    """A standby takes command once at least half of the job's ``nnodes`` node agents said hello to it."""
    return nnodes > 0 and 2 * heard_nodes >= nnodes


def promote_when_heard(job: Any, now: float) -> None:
    """A standby :class:`~mindft.flow.job.Job` takes command once half of the job's node agents said hello to it
    (then, if the job was under way, it rebuilds it: :func:`mindft.flow.hello.rejoin_when_heard`)."""
    heard = sorted(node for node in job.spares.nodes if node >= 0)
    nnodes = job.ranks.world_size // job.nproc if job.nproc else 0
    if not promotes(len(heard), nnodes):
        return
    job.standing_by = False
    job.emit(Promoted(job.term, f"node agents {heard} of {nnodes} said hello to this standby (at least half)"))
    if job.supersedes:
        job.next_fence = now
    job.tell_agents()


def stand_down(job: Any, message: Superseded) -> None:
    """A controller of a newer term commands the job: this one stands down for good, and tells its own
    node agent to join the job there as a spare."""
    if message.term <= job.term or job.superseded is not None:
        return
    job.superseded = message
    node = next((n for n, seen in job.spares.nodes.items() if seen.peer == job.spares.local), 0)
    reason = (f"the job is commanded in term {message.term} at {message.controller}; this controller (term "
              f"{job.term}) stands down")
    log.warning("%s", reason)
    job.emit(Send(job.spares.local, Replaced(node, reason, controller=message.controller)))


@dataclass(frozen=True)
class Move:
    """A node agent's link moves to the candidate at ``address``; ``here``: this agent's node is that
    candidate, and starts its controller (standing by) with ``term``."""

    address: str
    here: bool
    term: int


@dataclass
class Failover:
    """A node agent's view of the job's controllers: the term it knows, the candidates in order, and
    how many of them it moved past. ``address``: where this agent's own standby would listen."""

    address: str
    term: int = 0
    standbys: tuple[str, ...] = ()
    moved: int = 0

    def accepts(self, term: int) -> bool:
        """Whether a message of ``term`` may act here: none of an older term than this agent knows."""
        return term >= self.term

    def view(self, view: JobView) -> bool:
        """The controller's view; False (refused) when of an older term."""
        if not self.accepts(view.term):
            return False
        if view.term > self.term:
            self.term, self.moved = view.term, 0
        if view.standbys:
            self.standbys = view.standbys
        return True

    def silent(self) -> Optional[Move]:
        """The controller fell silent for :func:`takeover_after`: the next candidate (None: none left)."""
        while self.moved < len(self.standbys):
            candidate = self.standbys[self.moved]
            self.moved += 1
            if candidate:
                return Move(candidate, candidate == self.address, self.term + 1)
        return None
