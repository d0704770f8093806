"""A node agent that relays its ranks' control traffic: what it sends up to the controller, and when.

The ranks of a node talk to their agent; the agent talks to the controller for all of them, so the
controller's fan-in is the node count. What crosses the node's link:

* a rank's own event (registration, fault, done, costs, pace, replicas) goes up at once, as itself;
* the acknowledgements of one phase go up as one :class:`~mindft.protocol.AckBatch` per set of held
  steps, once every rank the relay serves acknowledged it, or ``linger`` seconds after the first
  (a rank that never answers must not hold its node's others back: the controller's phase deadline
  judges it, as it would judge the rank alone);
* step reports go up as one :class:`~mindft.protocol.StepBatch` when the node's slowest step rose,
  and at least every ``interval`` seconds in which nothing else went up: the node's heartbeat, which
  vouches only for the ranks the relay heard within ``silent_after`` (a silent rank is still found);
* a rank's heartbeat stops here: the relay answers it with the job's progress it last heard, as long
  as it heard the controller within ``silent_after`` (so a rank still finds a silent controller).

Nothing here does I/O or reads a clock: the agent's shell passes ``now`` and carries out the result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from mindft.protocol import Ack, AckBatch, ActionKind, Heartbeat, Message, Progress, StepBatch, StepReport

Identity = bytes  # a rank's identity on the relay's link, e.g. b"rank3.inc0"


@dataclass(frozen=True)
class Up:
    """Send ``message`` to the controller: as the rank ``identity``'s own (b"": the relay's)."""

    message: Message
    identity: Identity = b""


@dataclass(frozen=True)
class Down:
    """Send ``message`` to the rank ``identity``."""

    identity: Identity
    message: Message


@dataclass
class _Phase:
    """The acknowledgements of one action of one round not sent up yet, by the steps they hold."""

    first: float
    step: int
    held: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)


class Relay:
    """The relay of one node's ranks (see the module docstring)."""

    def __init__(self, linger: float, interval: float, silent_after: float, now: float) -> None:
        self.linger, self.interval, self.silent_after = linger, interval, silent_after
        self.ranks: dict[int, Identity] = {}  # the ranks served: registered through this relay, not gone
        self._heard: dict[int, float] = {}  # rank → when it last sent anything
        self._phases: dict[tuple[ActionKind, int], _Phase] = {}
        self._sent: set[tuple[ActionKind, int]] = set()  # phases whose batch went up: a late ack follows at once
        self._steps: dict[int, int] = {}  # rank → its newest step of ``_round``
        self._steps_unsent = False  # a step came since the last StepBatch
        self._round = 0
        self._sent_slowest = -1
        self._sent_at = now
        self.progress = 0  # the job's slowest step, as the controller last said
        self._controller_heard = -float("inf")

    def from_rank(self, identity: Identity, message: Message, now: float) -> list[Union[Up, Down]]:
        """A message of the rank ``identity``: what goes up now (or back to it)."""
        kind = type(message)
        rank = getattr(message, "rank", None)
        if rank is not None and rank >= 0:
            self.ranks.setdefault(rank, identity)
            self._heard[rank] = now
        if kind is Ack:
            return self._ack(message, now)
        if kind is StepReport:
            if message.round != self._round:
                if message.round < self._round:
                    return []  # a report sent before the rank saw the round: its progress was reset since
                self._round, self._steps, self._sent_slowest = message.round, {}, -1
            self._steps[message.rank] = max(message.step, self._steps.get(message.rank, message.step))
            self._steps_unsent = True
            return self._steps_due(now, rose_only=True)
        if kind is Heartbeat:
            heard = now - self._controller_heard <= self.silent_after
            return [Down(identity, Heartbeat(-1, 0, self.progress))] if heard else []
        if rank is None or rank < 0:
            return [Up(message, identity)]
        self.ranks[rank] = identity  # a new incarnation registers under its own identity
        # A rank's messages reach the controller in the order it sent them: what the relay holds of it
        # goes first (a Done that overtook its RESUME ack would be taken for one of the round before).
        held = [key for key, phase in self._phases.items() if rank in phase.acked]
        out = [up for key in held for up in self._batch(key)]
        if self._steps_unsent:
            out += self._steps_due(now, rose_only=False, force=True)
        self._sent_at = now
        return out + [Up(message, identity)]

    def new_controller(self) -> None:
        """The relay follows another controller (a standby took command), which counts its rounds
        afresh: what the relay held for the old one is dropped; the ranks it serves stay served."""
        self._phases.clear()
        self._sent.clear()
        self._steps, self._round, self._sent_slowest, self._steps_unsent = {}, 0, -1, False
        self.progress, self._controller_heard = 0, -float("inf")

    def rank_left(self, rank: int, now: float) -> list[Up]:
        """The rank's process is gone: no phase waits for it here any more."""
        self.ranks.pop(rank, None)
        self._steps.pop(rank, None)
        self._heard.pop(rank, None)
        return self._flush_complete(now)

    def from_controller(self, message: Message, now: float) -> None:
        """What the relay learns from a message of the controller (on its way to the ranks, or its own)."""
        self._controller_heard = now
        if type(message) is Progress or type(message) is Heartbeat:
            self.progress = max(self.progress, message.step)

    def tick(self, now: float) -> list[Up]:
        """Phases lingered long enough, and the node's heartbeat when it is due."""
        out = [self._batch(key) for key, phase in list(self._phases.items()) if now - phase.first >= self.linger]
        out = [up for batch in out for up in batch]
        return out + self._steps_due(now, rose_only=False)

    def next_wakeup(self) -> float:
        """When :meth:`tick` has something to do next."""
        lingering = min((phase.first + self.linger for phase in self._phases.values()), default=float("inf"))
        return min(lingering, self._sent_at + self.interval)

    def _ack(self, message: Ack, now: float) -> list[Up]:
        key = (message.action, message.round)
        phase = self._phases.get(key)
        if key in self._sent or (phase is not None and message.step != phase.step):
            # Late, or not the step its node's others acknowledged: up as it is, for the controller to judge.
            self._sent_at = now
            return [Up(message, self.ranks[message.rank])]
        if phase is None:
            phase = self._phases[key] = _Phase(now, message.step)
        if message.rank not in phase.acked:
            phase.acked.add(message.rank)
            phase.held.setdefault(tuple(message.held_steps), []).append(message.rank)
        return self._flush_complete(now)

    def _flush_complete(self, now: float) -> list[Up]:
        served = self.ranks.keys()
        complete = [key for key, phase in self._phases.items() if served <= phase.acked]
        out = [up for key in complete for up in self._batch(key)]
        if out:
            self._sent_at = now
        return out

    def _batch(self, key: tuple[ActionKind, int]) -> list[Up]:
        phase = self._phases.pop(key)
        self._sent = {sent for sent in self._sent if sent[1] >= key[1] - 1}  # a round's acks end with the next
        self._sent.add(key)
        action, round_ = key
        return [Up(AckBatch(action, phase.step, tuple(sorted(ranks)), held, round_)) for held, ranks in phase.held.items()]

    def _steps_due(self, now: float, rose_only: bool, force: bool = False) -> list[Up]:
        steps = self._steps
        slowest = min((steps.get(rank, -1) for rank in self.ranks), default=-1)
        rose = slowest > self._sent_slowest
        if not (rose or force) and (rose_only or now - self._sent_at < self.interval):
            return []
        self._sent_slowest = max(self._sent_slowest, slowest)
        self._sent_at, self._steps_unsent = now, False
        live = tuple(sorted(rank for rank in self.ranks if now - self._heard[rank] <= self.silent_after))
        # The acks it holds were sent before these steps: they go first.
        held = [up for key in list(self._phases) for up in self._batch(key)]
        return held + [Up(StepBatch(live, tuple(steps.get(rank, 0) for rank in live), self._round))]
