"""Goodput: every second of the job's wall time, counted as productive training or as one bucket of
badput (the figure peers publish as effective training time, ETTR; Google's ml-goodput-measurement
names the buckets).

The controller's clock runs from its start. While the job is

- ``STARTING``: **start-up** (processes, MindSpore's cluster forming, every rank registering);
- ``NORMAL``: training, of which the share the snapshots cost the step (the job's measured
  cadence cost) is **snapshots**; the steps that only redo what a recovery rolled back (up to the
  step the slowest rank had reached when the fault came) are **replayed**; the rest is
  **productive**, but for the share of it an elastic job lost by running fewer nodes than its
  MAX (:mod:`mindft.flow.elastic`), which is **smaller world**;
- ``PAUSING``, ``REPAIRING``, ``ROLLBACK``, ``RESUMING``: that phase of a recovery (**pause**,
  **repair** — waiting for a device, a process, a node —, **rollback**, **resume**);
- ``DONE`` or ``FAILED``: the clock stops.

The sum of the buckets and the productive time is the wall time, by construction. Times are
seconds on the controller's clock, passed in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mindft.protocol import JobState

PRODUCTIVE, STARTUP, SNAPSHOTS, REPLAYED, SMALLER = "productive", "start-up", "snapshots", "replayed", "smaller world"
_PHASES = {JobState.PAUSING: "pause", JobState.REPAIRING: "repair", JobState.ROLLBACK: "rollback",
           JobState.RESUMING: "resume"}
BADPUT = (STARTUP, SNAPSHOTS, *_PHASES.values(), REPLAYED, SMALLER)  # in the order a job meets them


@dataclass
class Goodput:
    """The job's wall time so far, by bucket (see the module docstring)."""

    started: float
    state: JobState = JobState.STARTING
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys((PRODUCTIVE, *BADPUT), 0.0))
    _since: float = -1.0  # when the current stretch began
    _reached: int = 0  # the step the slowest rank had reached before the last rollback
    _slowest: int = 0
    _cost: float = 0.0  # the snapshots' share of a step while training
    capacity: float = 1.0  # the share of its MAX nodes an elastic job trains on

    def __post_init__(self) -> None:
        self._since = self.started

    def moved(self, state: JobState, slowest: int, now: float) -> None:
        """The job moved to ``state`` (``slowest``: the step every rank has finished)."""
        self._count(now)
        if state is JobState.PAUSING and self.state is JobState.NORMAL:
            self._reached = max(self._reached, self._slowest)
        self.state, self._slowest = state, slowest

    def progress(self, slowest: int, cost: float, now: float) -> None:
        """Every rank has finished ``slowest``; snapshots cost ``cost`` of a step now (0.01: 1%)."""
        self._count(now)
        self._slowest, self._cost = slowest, max(0.0, min(cost, 1.0))

    def resized(self, capacity: float, now: float) -> None:
        """An elastic job trains on ``capacity`` of its MAX nodes from now on."""
        self._count(now)
        self.capacity = max(0.0, min(capacity, 1.0))

    def at(self, now: float) -> dict[str, float]:
        """Every bucket's seconds up to ``now``, productive first."""
        self._count(now)
        return dict(self.seconds)

    @property
    def wall(self) -> float:
        """Seconds counted so far (up to the last call, or the end)."""
        return sum(self.seconds.values())

    def _count(self, now: float) -> None:
        span, self._since = max(0.0, now - self._since), max(now, self._since)
        if self.state in (JobState.DONE, JobState.FAILED) or span == 0.0:
            return
        if self.state is JobState.STARTING:
            self.seconds[STARTUP] += span
        elif self.state is JobState.NORMAL:
            if self._slowest < self._reached:
                self.seconds[REPLAYED] += span
            else:
                self.seconds[SNAPSHOTS] += span * self._cost
                self.seconds[SMALLER] += span * (1.0 - self._cost) * (1.0 - self.capacity)
                self.seconds[PRODUCTIVE] += span * (1.0 - self._cost) * self.capacity
        else:
            self.seconds[_PHASES[self.state]] += span


def ratio(seconds: dict[str, float]) -> float:
    """The productive share of the wall time (0 before any time passed)."""
    wall = sum(seconds.values())
    return seconds.get(PRODUCTIVE, 0.0) / wall if wall > 0 else 0.0
