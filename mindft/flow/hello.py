"""A node agent's hello to the controller (:class:`~mindft.protocol.AgentHello`): which ranks it runs
and, while the job is STARTING, whether what it holds shows the job was under way before this
controller (:mod:`mindft.flow.rejoin`)."""
from __future__ import annotations

import logging
from typing import Any

from mindft.flow import elastic, lost, standby
from mindft.flow.effects import GiveNode, Peer, Send
from mindft.flow.replicas import rank_list
from mindft.flow.spares import given_away
from mindft.flow.states import JobState
from mindft.protocol import AgentHello, Replaced

log = logging.getLogger(__name__)

_S = JobState


def agent_hello(job: Any, peer: Peer, message: AgentHello, now: float) -> None:
    """A node agent (re)connected: its ranks' orders go to it from now on; it gets the job's
    view and, again, any order still pending for its ranks (one may have been lost with its
    previous connection). While STARTING, what it says it runs and holds may show that the
    job was under way before this controller (:mod:`mindft.flow.rejoin`)."""
    if message.spare and message.term > job.term:
        # A spare that follows a newer term is that controller's: this one was superseded (its Superseded is
        # on the way, after a partition healed) and must not give it a node.
        log.info("a spare that follows term %d, newer than this controller's %d: not this job's spare", message.term,
                 job.term)
        return
    if message.term < job.min_hello_term and not message.spare and peer in job.resized_links:
        # Said before its agent learnt of the resize, as its node before: it says hello again as its new
        # node (told Replaced, it would leave with its ranks' memory). An agent the resize was not told
        # to (a spare given a node since, a launcher started again for a lost node) is heard.
        return
    behind = "" if message.spare else elastic.left_behind(job, peer, message.node, now)
    given = None if behind else job.spares.hello(peer, message.node, message.ranks, message.spare, now,
                                                  message.address)
    if given is not None or behind:
        job.emit(Send(peer, Replaced(message.node, behind or given_away(given.node, given.number, given.reason))))
        return
    if message.spare:
        job.emit(Send(peer, job.view()))
        if job.state is _S.STARTING and job.survivors.under_way:
            rejoin_when_heard(job, now)  # a spare for the nodes no agent speaks for
        return
    job.nproc = job.nproc or len(message.ranks)
    world = job.ranks.world_size
    ranks = [r for r in message.ranks if 0 <= r < world]
    if len(ranks) != len(message.ranks):
        log.warning("node agent %d names ranks outside 0..%d: %s", message.node, world - 1, list(message.ranks))
    new = [r for r in ranks if job.agents.get(r) != peer]
    for rank in ranks:
        job.agents[rank] = peer
    if new:
        log.info("node agent %d runs %s", message.node, rank_list(new))
    job.emit(Send(peer, job.view()))
    for rank in ranks:
        job.ladder.repeat_order(rank, peer)
    if job.state is _S.STARTING:
        job.survivors.hello(message)
        if job.standing_by:
            standby.promote_when_heard(job, now)
        if not job.standing_by and job.survivors.under_way:
            rejoin_when_heard(job, now)

def rejoin_when_heard(job: Any, now: float) -> None:
    """The job was under way: rebuild it once every rank's node agent said what it holds (until
    then, or timeouts.register, the job waits); the nodes no agent speaks for go to warm spares.
    A standby waits for its promotion."""
    if job.standing_by:
        return
    unheard = job.survivors.unheard()
    # The agents of a resized world stop their ranks and rename their memory before they say hello
    # as their new nodes: a node is given to a spare only once its agent stayed silent as a lost one's.
    settling = bool(job.resizes) and now - job.history[0][1] < job.spares.silent_after
    if unheard and job.nproc and job.spares.waiting and not settling:
        nodes = sorted({rank // job.nproc for rank in unheard})
        for adoption in job.spares.give(nodes, {node: tuple(range(node * job.nproc, (node + 1) * job.nproc))
                                                 for node in nodes}, now, job.timeouts.repair):
            job.emit(GiveNode(adoption.node, adoption.peer, adoption.number, adoption.reason))
    if not unheard:
        lost.rejoin(job.ladder, now, job.rebuild_reason or (
            f"the standby controller took command (term {job.term})" if job.term
            else "the controller started again while the job was under way"))
