"""A rank's view of its controller's liveness: when to heartbeat, when to reconnect, when to give up.

Paranoid-Pirate style. Any frame proves its sender alive, so a heartbeat is due only after an
interval in which the rank sent nothing (step reports count) or heard nothing; the controller
answers each. A controller silent for ``dead_after`` is unreachable: the rank reconnects (same
identity) and re-registers, and gives up after ``retries`` silent periods in a row, or after
``first_contact_retries`` when it never heard the controller at all. Times are seconds on one
monotonic clock, passed in by the shell (:mod:`mindft.rank.processor`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    """What the controller's silence means for the rank now."""

    ALIVE = "alive"              # heard within dead_after (or nothing to decide yet)
    RECONNECT = "reconnect"      # silent for dead_after: reconnect and re-register
    NEVER_ANSWERED = "never"     # no frame ever heard, first-contact patience spent: give up
    SILENT = "silent"            # heard before, then silent for ``retries`` periods: give up


@dataclass(frozen=True)
class Check:
    """The decision of :meth:`Liveness.check`: send a heartbeat now?, and the verdict on silence."""

    beat: bool
    verdict: Verdict
    silent_for: float = 0.0   # seconds since the controller was last heard (before a reconnect)
    periods: int = 0          # silent periods in a row, this one included


class Liveness:
    """The heartbeat and silence clocks of one rank's connection (see the module docstring)."""

    def __init__(self, interval: float, dead_after: float, retries: int, first_contact_retries: int,
                 now: float) -> None:
        self.interval = interval
        self.dead_after = dead_after
        self.retries = retries
        self.first_contact_retries = first_contact_retries
        self.last_heard = self.last_sent = self.last_beat = now
        self.silent_periods = 0
        self.heard = False  # any frame from the controller since the start

    def sent(self, now: float) -> None:
        """A frame went out on the connection."""
        self.last_sent = now

    def registering(self, now: float) -> None:
        """The registration went out: the controller's silence counts from now."""
        self.last_heard = now

    def received(self, now: float) -> None:
        """A frame came from the controller."""
        self.silent_periods, self.last_heard, self.heard = 0, now, True

    def timeout(self, now: float, reported_at: float) -> float:
        """Seconds until the next :meth:`check` may decide something (``reported_at``: the newest
        step report sent on the training thread's own socket)."""
        beat_due = min(max(self.last_sent, reported_at), max(self.last_heard, self.last_beat)) + self.interval
        return max(0.0, min(beat_due, self.last_heard + self.dead_after) - now)

    def check(self, now: float, reported_at: float) -> Check:
        """Decide at ``now``: a heartbeat is due, and/or the controller's silence calls for action."""
        beat = (now - max(self.last_sent, reported_at) >= self.interval
                or now - max(self.last_heard, self.last_beat) >= self.interval)
        if beat:
            self.last_sent = self.last_beat = now  # also when the send is dropped: next try an interval later
        silent_for = now - self.last_heard
        if silent_for <= self.dead_after:
            return Check(beat, Verdict.ALIVE)
        self.silent_periods += 1
        periods = self.silent_periods
        if not self.heard and periods >= self.first_contact_retries:
            return Check(beat, Verdict.NEVER_ANSWERED, silent_for, periods)
        if periods >= self.retries:
            return Check(beat, Verdict.SILENT, silent_for, periods)
        self.last_heard = self.last_sent = self.last_beat = now  # a fresh connection: its clocks restart
        return Check(beat, Verdict.RECONNECT, silent_for, periods)
