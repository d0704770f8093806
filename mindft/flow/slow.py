"""Slow ranks: a rank whose own work per step is slower than its peers' for several windows in a row.

In data parallelism every rank waits for the slowest at each all-reduce, so its step time says
nothing of which rank is slow; its own work does: the step up to its collectives (PyNative: the
collective gate of :mod:`mindft.mindspore`), or the whole step where it has none. Each rank measures
its own work per step (:class:`PaceMeter`) and reports its median a few times per window
(:class:`~mindft.protocol.Pace`): a median, for a step the scheduler preempted on a busy host is
no slow rank. At the end of each window of the controller's clock (:class:`SlowRanks`), a rank is
slow in it when its work per step (the median of its reports) exceeds the median of its peers' by
more than the threshold; ``windows`` slow windows in a row flag it (and its node), as many
healthy windows in a row clear it. The defaults are MindCluster's slow-node detection's: 30%, 3
windows of 30 s. Only training counts: a window under way when a recovery starts is discarded.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from mindft.config import MindftConfig

# A window in which a rank finished fewer steps says nothing of its pace (a recovery's replayed step,
# a job that trains a step a minute).
MIN_STEPS = 3
REPORTS_PER_WINDOW = 3  # a rank's reports per window: a lost or late one costs a third of a window


@dataclass(frozen=True)
class SlowPolicy:
    """``threshold``: how much slower than its peers' median a rank's own work per step may be (0.3:
    30%); ``windows``: the windows in a row that flag it, and clear it; ``window``: seconds;
    ``to_spare``: a flagged rank's node is given to a warm spare (:meth:`~mindft.flow.spares.Spares.replace_slow`)."""

    threshold: float = 0.3
    windows: int = 3
    window: float = 30.0
    to_spare: bool = False  # a node flagged slow is given to a live warm spare (MINDFT_SLOW_ACTION=spare)

    def __post_init__(self) -> None:
        if not (self.threshold > 0 and self.windows >= 1 and self.window > 0):
            raise ValueError(f"need threshold > 0, windows >= 1, window > 0; got {self}")

    @property
    def report_every(self) -> float:
        """Seconds between a rank's reports of its pace."""
        return self.window / REPORTS_PER_WINDOW


def policy_of(config: MindftConfig) -> SlowPolicy:
    """The job's policy: MINDFT_SLOW_THRESHOLD, MINDFT_SLOW_WINDOWS, MINDFT_SLOW_WINDOW, MINDFT_SLOW_ACTION."""
    return SlowPolicy(config.slow_threshold, config.slow_windows, config.slow_window, config.slow_action == "spare")


@dataclass(frozen=True)
class SlowChange:
    """A rank flagged slow (``slow``) or cleared, with its work per step over its peers' median
    (``ratio``: 1.5 is 50% slower) in the window that decided."""

    rank: int
    slow: bool
    ratio: float

    def reason(self, node: int, policy: SlowPolicy) -> str:
        """The change in words, naming the rank's ``node`` (-1: unknown)."""
        where = f"rank {self.rank}" + (f" (node {node})" if node >= 0 else "")
        if self.slow:
            return (f"{where} is slow: its own work per step is {self.ratio:.2f}× its peers' median, over "
                    f"{1 + policy.threshold:.2f}× in {policy.windows} windows of {policy.window:g} s in a row")
        return f"{where} is no longer slow: {self.ratio:.2f}× its peers' median in {policy.windows} windows in a row"


class PaceMeter:
    """A rank's own work per step since its last report, and when the next one is due (its side of the rule)."""

    def __init__(self, report_every: float) -> None:
        self.report_every = report_every
        self.samples: list[float] = []
        self._next: Optional[float] = None

    def work(self, seconds: float) -> None:
        """One step's own work: its start to its collectives (or its end)."""
        self.samples.append(max(seconds, 0.0))

    def due(self, now: float) -> Optional[tuple[int, float]]:
        """(steps, their median own work in seconds) to report at ``now``, if due; then it counts afresh."""
        if self._next is None:
            self._next = now + self.report_every
            return None
        if now < self._next or not self.samples:
            return None
        figures = (len(self.samples), statistics.median(self.samples))
        self.samples = []
        self._next = now + self.report_every
        return figures


class SlowRanks:
    """The controller's side: every rank's pace per window, and the ranks flagged slow."""

    def __init__(self, policy: SlowPolicy, now: float) -> None:
        self.policy = policy
        self.window_end = now + policy.window
        self.flagged: set[int] = set()  # the ranks flagged slow
        self.ratios: dict[int, float] = {}  # rank → its ratio in the newest window that measured it
        self._work: dict[int, list[tuple[int, float]]] = {}  # rank → its reports in the window under way
        self._streak: dict[int, int] = {}  # rank → slow windows in a row (> 0), or healthy ones (< 0)

    def pace(self, rank: int, steps: int, seconds: float) -> None:
        """Rank ``rank``'s own work per step was ``seconds`` (a median) over ``steps`` steps."""
        self._work.setdefault(rank, []).append((max(steps, 0), max(seconds, 0.0)))

    def discard(self, now: float) -> None:
        """Training stopped or starts again: the window under way measures nothing; one starts at ``now``."""
        self._work.clear()
        self.window_end = now + self.policy.window

    def due(self, now: float) -> list[SlowChange]:
        """At the end of a window: the ranks flagged or cleared by it."""
        if now < self.window_end:
            return []
        work, self._work = self._work, {}
        self.window_end = now + self.policy.window
        paces = {rank: statistics.median(seconds for _, seconds in reports) for rank, reports in work.items()
                 if sum(steps for steps, _ in reports) >= MIN_STEPS}
        paces = {rank: pace for rank, pace in paces.items() if pace > 0}
        if len(paces) < 2:
            return []
        changes = []
        for rank, pace in sorted(paces.items()):
            ratio = pace / statistics.median(p for r, p in paces.items() if r != rank)
            self.ratios[rank] = ratio
            slow = ratio > 1 + self.policy.threshold
            streak = self._streak.get(rank, 0)
            streak = max(streak, 0) + 1 if slow else min(streak, 0) - 1
            self._streak[rank] = streak
            if rank in self.flagged and -streak >= self.policy.windows:
                self.flagged.discard(rank)
                changes.append(SlowChange(rank, False, ratio))
            elif rank not in self.flagged and streak >= self.policy.windows:
                self.flagged.add(rank)
                changes.append(SlowChange(rank, True, ratio))
        return changes
