"""What a node agent's relay (:mod:`mindft.flow.relay`) sends the job for its node's ranks, in one
message each: a node's acknowledgement of a phase (:class:`~mindft.protocol.AckBatch`) and its ranks'
steps (:class:`~mindft.protocol.StepBatch`), which is the node's heartbeat too. A relay speaks only
for the ranks that registered through it; what it says for any other rank is dropped, and said.
"""
from __future__ import annotations

import logging
from typing import Any

from mindft.flow.effects import Peer, Send, relay_of
from mindft.flow.ranks import RankRecord
from mindft.flow.replicas import rank_list
from mindft.flow.states import TERMINAL_STATES
from mindft.protocol import AckBatch, ActionKind, Heartbeat, StepBatch

log = logging.getLogger(__name__)

ACK_WHAT = {kind: f"{kind.name} ack" for kind in ActionKind}  # formatted once: an ack arrives per rank per phase


def node_acks(job: Any, peer: Peer, message: AckBatch, now: float) -> None:
    """A relay's acknowledgement of a phase by its node's ranks: when the phase takes it, the ranks'
    records are checked and moved in one pass (a phase brings one such batch per node)."""
    ladder = job.ladder
    if ladder.takes(message.action, message.step, message.round):
        strays = ladder.acks(relay_of(peer), message.ranks, message.action, message.held_steps, now)
        _dropped(peer, strays, ACK_WHAT[message.action])
        return
    records = relayed(job, peer, message.ranks, now, ACK_WHAT[message.action])  # heard all the same
    if records:
        ladder.ignored([record.rank for record in records], message.action, message.step, message.round)


def node_steps(job: Any, peer: Peer, message: StepBatch, now: float) -> None:
    """A relay's steps of its ranks; the relay's heartbeat too, answered like a rank's."""
    if len(message.steps) != len(message.ranks):
        log.warning("dropped a step batch from relay %r: %d ranks, %d steps", peer[:32], len(message.ranks),
                    len(message.steps))
        return
    steps = dict(zip(message.ranks, message.steps))
    records = relayed(job, peer, message.ranks, now, "steps")
    if message.round == job.recovery.round:
        advance = job.ranks.advance
        rose = False
        for record in records:
            rose = advance(record, steps[record.rank]) or rose
        job.advanced(rose, now)
    if job.state not in TERMINAL_STATES:
        job.emit(Send(peer, Heartbeat(-1, 0, job.ranks.slowest)))


def relayed(job: Any, peer: Peer, ranks: tuple[int, ...], now: float, what: str) -> list[RankRecord]:
    """The live records of ``ranks`` that registered through the relay ``peer``, heard at ``now`` (the
    rest: dropped)."""
    records, strays = job.ranks.reached(relay_of(peer), ranks)
    _dropped(peer, strays, what)
    live = [record for record in records if record.alive]
    for record in live:
        record.last_seen = now
    return live


def _dropped(peer: Peer, strays: list[int], what: str) -> None:
    if strays:
        log.warning("dropped %s for ranks that did not register through relay %r: %s", what, peer[:32],
                    rank_list(strays))
