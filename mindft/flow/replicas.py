"""The replica rules: when a rank counts as unprotected, and when a lost node leaves no common step.

Two judges look at the same replicas from two sides, with time passed in:

- **the node's sender** (:class:`Protection`, one per local rank): a replica that falls behind
  the newest local snapshot for more than ``lost_after`` seconds plus its bytes at
  :data:`ACK_MIN_RATE`, or by more than :data:`LOST_AFTER_CAPTURES` captures, is LOST
  PROTECTION; the verdict changes once when it is lost and once when it is restored, and the
  sender reports it to the controller (:class:`~mindft.protocol.ReplicaReport`).
  A rank that replicates itself also holds its step reports back until the replica of the
  capture they pass has arrived (:class:`ReportHold`).
- **the controller** (:class:`ReplicaWatch`, held by :class:`~mindft.flow.job.Job`): from those
  reports, a replica older than both steps every rank keeps is LOST PROTECTION, and so is one
  the agent says fell behind or one held by a node that was lost; logged once and once when
  restored, shown by ``mindft status``.

After a node is lost its ranks can roll back only to their replicas' steps:
:func:`replicas_share_a_step` says whether a common step is still possible and
:func:`no_common_step` says why not, for the dying-gasp rung.
"""
from __future__ import annotations

import collections
import enum
import logging
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from mindft.protocol import ReplicaReport

log = logging.getLogger(__name__)

LOST_AFTER = 5.0           # s a local snapshot may wait for its replica before protection counts as lost
LOST_AFTER_CAPTURES = 20   # or this many newer captures than the newest replica
ACK_MIN_RATE = 20e6        # bytes/s: slower than this the keeper counts as gone (reconnect, look it up again)


class ProtectionChange(enum.Enum):
    """A change of one rank's protection."""

    LOST = "lost"
    RESTORED = "restored"


@dataclass
class Protection:
    """One local rank's replica as its node's sender judges it (the sender's lock held)."""

    lost_after: float = LOST_AFTER
    lost_after_captures: int = LOST_AFTER_CAPTURES
    captures: int = 0                       # snapshots noticed so far
    replicated_capture: int = 0             # the capture the keeper confirmed last
    behind_since: Optional[float] = None    # when the oldest snapshot newer than the replica was noticed
    nbytes: int = 0                         # the size of the newest push: a large one may take longer
    lost: bool = False
    noticed: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))  # (capture, at)

    def capture(self, now: float) -> int:
        """A new local snapshot was noticed at ``now``; its capture number."""
        self.captures += 1
        self.noticed.append((self.captures, now))
        if self.behind_since is None:
            self.behind_since = now
        return self.captures

    def confirmed(self, capture: int) -> None:
        """The keeper holds capture ``capture``: the replica is behind only the snapshots noticed since."""
        self.replicated_capture = capture
        newer = [at for number, at in self.noticed if number > capture]
        self.behind_since = newer[0] if newer else None

    def behind(self, now: float) -> tuple[int, float]:
        """(captures, seconds) the replica is behind the newest local snapshot."""
        if self.behind_since is None:
            return 0, 0.0
        return self.captures - self.replicated_capture, now - self.behind_since

    def judge(self, now: float) -> Optional[ProtectionChange]:
        """Lost or restored at ``now``, if that changed since the last judgment."""
        captures, seconds = self.behind(now)
        lost = captures > self.lost_after_captures or seconds > self.lost_after + self.nbytes / ACK_MIN_RATE
        was, self.lost = self.lost, lost
        if lost and not was:
            return ProtectionChange.LOST
        if was and not lost:
            return ProtectionChange.RESTORED
        return None


class ReportHold:
    """A rank's step reports held back until its replica arrived (a rank replicating itself).

    A step report tells the other ranks they may overwrite older snapshots, so it must not pass
    a capture whose replica has not arrived, or a kill of this rank would leave no step that
    every rank, this one through its replica, still holds. Training never waits for it; only
    the report does. A restore starts a new ``epoch``: a push of the timeline before it proves
    nothing, and the restored step must be replicated again before reports go on. While the
    rank's protection is lost the reports go on without it."""

    def __init__(self) -> None:
        self.epoch = 0
        # (capture seq, step) of the snapshots taken whose replica is not confirmed, oldest first
        self._unconfirmed: collections.deque = collections.deque(maxlen=64)

    def captured(self, seq: int, step: int) -> None:
        """The store started capturing ``step`` as capture ``seq``."""
        self._unconfirmed.append((seq, step))

    def restored(self, step: int) -> int:
        """Training was rolled back to ``step``; the new epoch."""
        self.epoch += 1
        self._unconfirmed.clear()
        self._unconfirmed.append((-1, step))  # cleared by the first push of the new epoch: that snapshot
        return self.epoch

    def confirmed(self, seq: int, epoch: int) -> None:
        """The keeper holds capture ``seq`` of ``epoch``: every capture up to it is replicated."""
        if epoch == self.epoch:
            while self._unconfirmed and self._unconfirmed[0][0] <= seq:
                self._unconfirmed.popleft()

    def reportable(self, position: int, lost: bool) -> int:
        """The newest step, at most ``position``, the rank may report finished now (``lost``: its
        protection is lost, the reports go on without it)."""
        if not self._unconfirmed or lost:
            return position
        return min(position, self._unconfirmed[0][1] - 1)

    @property
    def unconfirmed(self) -> tuple[int, ...]:
        """Steps captured (or restored) whose replica has not been confirmed yet."""
        return tuple(step for _, step in self._unconfirmed)


@dataclass(frozen=True)
class KeptSteps:
    """The two snapshot steps every rank keeps (``oldest`` and ``newest``), and the step every rank finished."""

    oldest: int
    newest: int
    finished: int


@dataclass
class ReplicaWatch:
    """The controller's view of every rank's replica, from the node agents' reports."""

    reported: dict[int, tuple[int, bool]] = field(default_factory=dict)  # rank → (replicated step, agent: lost)
    unprotected: set[int] = field(default_factory=set)  # ranks judged LOST PROTECTION (logged once)
    _gone: dict[int, int] = field(default_factory=dict)  # rank → step of its replica held by a node that was lost

    def step(self, rank: int) -> int:
        """The newest step ``rank``'s replica was reported to hold (-1: none)."""
        return self.reported.get(rank, (-1, False))[0]

    def report(self, message: ReplicaReport, world: int, kept: Optional[KeptSteps]) -> str:
        """A node agent's report of its ranks' replicas; what is wrong with it ("": nothing).
        ``kept`` is None while the job is not running normally (the steps are being rolled back)."""
        if len(message.ranks) != len(message.steps):
            return "ranks and steps differ in length"
        bad = next((r for r in message.ranks if not 0 <= r < world), None)
        if bad is not None:
            return f"rank {bad} is outside 0..{world - 1}"
        lost = set(message.lost)
        for rank, step in zip(message.ranks, message.steps):
            gone = self._gone.get(rank)
            if gone is not None:
                if step == gone:
                    step = -1  # its agent has not noticed yet that the node holding that replica is gone
                else:
                    del self._gone[rank]
            self.reported[rank] = (step, rank in lost)
            self._judge(rank, step, rank in lost, kept)
        return ""

    def _judge(self, rank: int, step: int, agent_lost: bool, kept: Optional[KeptSteps]) -> None:
        """LOST PROTECTION when ``rank``'s replica is older than both steps every rank keeps (the
        newest snapshot step every rank finished and the one before: a loss of its node now could
        not be recovered), or its agent says it fell behind; restored once the replica holds that
        newest step. Between the two nothing changes, so a replica that lags by about one snapshot
        is not logged on every report. No replica yet (-1) is left to the agent's own judgment.
        During a recovery (``kept`` None) the steps are being rolled back: only the agent's verdict counts."""
        if kept is None and not agent_lost:
            return
        was = rank in self.unprotected
        if agent_lost or 0 <= step < kept.oldest:
            if not was:
                self.unprotected.add(rank)
                why = (f"its node agent reports its replica fell behind (newest replicated: step {step})"
                       if agent_lost else f"its newest replica (step {step}) is older than both steps every "
                                          f"rank keeps ({kept.oldest} and {kept.newest})")
                log.warning("rank=%d LOST PROTECTION: %s; were its node lost now, the job could only end with "
                            "dying-gasp checkpoints", rank, why)
        elif was and step >= kept.newest:
            self.unprotected.discard(rank)
            log.warning("rank=%d protection restored: its replica holds step %d (every rank finished step %d)",
                        rank, step, kept.finished)

    def node_lost(self, node: int, replicas_of: Iterable[int], ended: bool) -> None:
        """``node`` was lost with the replicas it kept of ``replicas_of``: those ranks are unprotected
        (unless the job ``ended``) until their agents push to the new node."""
        for rank in replicas_of:
            step = self.step(rank)
            if step >= 0:
                self._gone[rank] = step
            self.reported[rank] = (-1, False)
            if rank not in self.unprotected and not ended:
                self.unprotected.add(rank)
                log.warning("rank=%d LOST PROTECTION: its replica (step %d) was on node %d, which was lost; "
                            "restored once its agent has pushed it to the new node", rank, step, node)

    def recovering(self, rank: int) -> None:
        """``rank`` is being recovered: its protection is the recovery's question."""
        self.unprotected.discard(rank)


def replicas_share_a_step(lost: Mapping[int, Sequence[int]], known: Optional[frozenset[int]]) -> bool:
    """True while a common rollback step is possible: the steps the lost ranks' replicas hold
    (``lost``: rank → steps) share one, also with ``known`` (the steps every other rank that
    reported this round holds; None: none counted). O(lost ranks)."""
    if not lost:
        return True
    common = frozenset.intersection(*(frozenset(held) for held in lost.values()))
    if known is not None:
        common &= known
    return bool(common)


def no_common_step(lost: Mapping[int, Sequence[int]], nodes: Iterable[int],
                   others: Iterable[tuple[int, Sequence[int]]]) -> str:
    """Why the job ends with dying-gasp checkpoints: the lost ranks (of ``nodes``) can roll back
    only to their replicas' steps, which the other ranks known this round (``others``: (rank,
    steps held)) do not share. A rank not known yet could only narrow them."""
    known: dict[tuple[int, ...], list[int]] = {}
    for rank, held in others:
        known.setdefault(tuple(sorted(held)), []).append(rank)
    replicas = ", ".join(f"rank {r} only to " + (f"step {held[0]} (its replica)" if held
                                                  else "nothing (no replica)")
                         for r, held in sorted(lost.items())[:8]) + (", ..." if len(lost) > 8 else "")
    kept = "".join(f"; {rank_list(sorted(ranks))} {'hold' if len(ranks) > 1 else 'holds'} {list(held)}"
                   for held, ranks in sorted(known.items()))
    nodes = sorted(set(nodes))
    return (f"node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} lost: {replicas} can roll "
            f"back{kept}: no step every rank can restore, so the job ends with dying-gasp checkpoints instead "
            f"of a recovery that would lose the lost ranks' state")


def rank_list(ranks: list[int], limit: int = 8) -> str:
    """"rank 3" or "ranks 0, 1, 2, ..." for a log line."""
    shown = ", ".join(map(str, ranks[:limit])) + (", ..." if len(ranks) > limit else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
