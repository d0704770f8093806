"""Which steps are snapshotted: the cadence schedule, and how the job picks a cadence.

A :class:`Schedule` is a list of segments ``(start, every)``: from step ``start`` on, steps
``start, start + every, ...`` are capture steps, until the next segment's start (itself a
capture step). Step 0 is always one (the state training starts from). Every rank and the
job use the same schedule, so they agree on every capture step; the job only ever appends a
segment that starts past any step a rank can already have decided about
(:meth:`Schedule.switch_point`), so a change never rewrites a decision already taken.

:func:`choose_every` is the overhead budget: snapshot every N-th step with
N = ceil(capture_time / (budget * step_time)), at most ``max_replay`` (the steps a recovery
may replay), and, when a failure rate is known (MindSpore's ATO statistics), at most
Young's interval sqrt(2 * capture_time / (failure_rate * step_time)).

The figures it is given are warm (:class:`WarmMean`): a cost's first sample (the first snapshot
into fresh memory, the first push with its connection's set-up) is left out, for a cadence chosen
from it would hold until the next sample, N steps later, and a change starts up to three capture
steps after that.
"""
from __future__ import annotations

import bisect
import logging
import math
import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

log = logging.getLogger(__name__)

# A cadence that snapshots less often than the budget allows is replaced only if the budget's
# choice is this factor more frequent: measured figures wobble, and every change is announced
# to every rank. One that snapshots more often than the budget allows is replaced at once.
HYSTERESIS = 1.25
# A cadence chosen to snapshot more often keeps this share of the budget: the budget's own choice
# sits just under it, where the next wobble of the figures would undo it (1 -> 2 -> 1 in six steps).
HEADROOM = 0.8


@dataclass(frozen=True)
class Budget:
    """How the job chooses its cadence: ``overhead`` is the slowdown allowed (0.01: 1%),
    ``max_replay`` the most steps a recovery may replay, ``failure_rate`` faults per step
    (MindSpore's ATO statistics; 0: unknown)."""

    overhead: float = 0.01
    max_replay: int = 100
    failure_rate: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.overhead <= 1 or self.max_replay < 1 or self.failure_rate < 0:
            raise ValueError(f"need 0 < overhead <= 1, max_replay >= 1, failure_rate >= 0; got {self}")


def choose_every(step_time: float, capture_time: float, budget: Budget) -> int:
    """The cadence that keeps ``capture_time`` per snapshot within the budget of ``step_time``."""
    if step_time <= 0 or capture_time <= 0:
        return 1 if capture_time <= 0 else budget.max_replay
    every = math.ceil(capture_time / (budget.overhead * step_time) - 1e-9)
    if budget.failure_rate > 0:
        every = min(every, max(1, round(math.sqrt(2 * capture_time / (budget.failure_rate * step_time)))))
    return max(1, min(every, budget.max_replay))


def overhead_of(step_time: float, capture_time: float, every: int) -> float:
    """The slowdown a snapshot every ``every`` steps costs (0.01: 1%)."""
    return capture_time / (every * step_time) if step_time > 0 else 0.0


def smoothed(previous: Optional[float], sample: float, weight: float) -> float:
    """An exponentially weighted mean of measured costs: ``sample`` alone at first, then each
    new sample counts with ``weight`` (one slow step must not swing the cadence)."""
    return sample if previous is None else previous + weight * (sample - previous)


# The samples of a cost that are cold and left out of its figure (:class:`WarmMean`). One is
# enough: a replica's first push measured 0.050 s of CPU with its CurveZMQ handshake and the
# keeper's first write, the next ones 0.004 s (issue 35).
COLD_SAMPLES = 1


class WarmMean:
    """A measured cost, smoothed (:func:`smoothed`, with ``weight``), that leaves out its first
    ``cold`` samples: :attr:`value` is None until a warm one came, then their mean alone."""

    def __init__(self, weight: float, cold: int = COLD_SAMPLES) -> None:
        self.weight = weight
        self.cold = cold  # samples still to leave out
        self.value: Optional[float] = None

    def cold_again(self) -> None:
        """The set-up is paid again (a new connection): leave out the next samples as the first ones.
        The figure so far stays until a warm sample follows it."""
        self.cold = max(self.cold, COLD_SAMPLES)

    def add(self, sample: float) -> None:
        if self.cold > 0:
            self.cold -= 1
            return
        self.value = smoothed(self.value, sample, self.weight)


def worth_changing(current: int, proposed: int) -> bool:
    """True when ``proposed`` differs enough from ``current`` to announce it: always when the
    current cadence is over the budget (``proposed`` is larger: snapshot less often), and when
    ``proposed`` is :data:`HYSTERESIS` times more frequent (the budget allows more snapshots)."""
    return proposed > current or proposed * HYSTERESIS <= current


class ScheduleError(ValueError):
    """A schedule is malformed, or a new one rewrites steps already decided."""


@dataclass(frozen=True)
class Schedule:
    """The capture steps: segments ``(start, every)`` in increasing ``start``, the first at 0."""

    segments: tuple[tuple[int, int], ...] = ((0, 1),)

    def __post_init__(self) -> None:
        segments = self.segments
        if not segments or segments[0][0] != 0:
            raise ScheduleError(f"a schedule starts at step 0, got {segments}")
        for (start, every), (following, _) in zip(segments, segments[1:] + ((math.inf, 1),)):
            if every < 1 or following <= start:
                raise ScheduleError(f"segments need every >= 1 and increasing starts, got {segments}")
            if following != math.inf and (following - start) % every:
                raise ScheduleError(f"segment start {following} is not a capture step of ({start}, {every})")
        object.__setattr__(self, "_starts", [start for start, _ in segments])

    @classmethod
    def fixed(cls, every: int) -> Schedule:
        if every < 1:
            raise ScheduleError(f"snapshot_every must be >= 1, got {every}")
        return cls(((0, every),))

    # ---- the wire form: start0, every0, start1, every1, ... --------------------------------

    def wire(self) -> tuple[int, ...]:
        return tuple(v for segment in self.segments for v in segment)

    @classmethod
    def from_wire(cls, values: Sequence[int]) -> Schedule:
        if len(values) % 2 or not values:
            raise ScheduleError(f"a schedule on the wire is start/every pairs, got {list(values)}")
        return cls(tuple((values[i], values[i + 1]) for i in range(0, len(values), 2)))

    # ---- queries ----------------------------------------------------------------------------

    def _segment(self, step: int) -> tuple[int, int]:
        return self.segments[bisect.bisect_right(self._starts, step) - 1]  # type: ignore[attr-defined]

    def every_at(self, step: int) -> int:
        """The cadence in force at ``step`` (>= 0)."""
        return self._segment(max(step, 0))[1]

    def is_capture(self, step: int) -> bool:
        if step < 0:
            return False
        start, every = self._segment(step)
        return (step - start) % every == 0

    def at_or_before(self, step: int) -> int:
        """The newest capture step <= ``step`` (-1 when ``step`` < 0)."""
        if step < 0:
            return -1
        start, every = self._segment(step)
        return step - (step - start) % every

    def before(self, step: int, count: int = 1) -> int:
        """The ``count``-th capture step before ``step`` (-1 when there are not that many)."""
        for _ in range(count):
            step = self.at_or_before(step - 1)
            if step < 0:
                return -1
        return step

    def after(self, step: int, count: int = 1) -> int:
        """The ``count``-th capture step after ``step``."""
        for _ in range(count):
            index = bisect.bisect_right(self._starts, step)  # type: ignore[attr-defined]
            start, every = self.segments[index - 1] if step >= 0 else self.segments[0]
            candidate = start + ((max(step, start - 1) - start) // every + 1) * every
            if index < len(self.segments):
                candidate = min(candidate, self.segments[index][0])
            step = candidate
        return step

    def held_after(self, progress: int, keep: int = 2) -> frozenset[int]:
        """The capture steps a rank that finished ``progress`` steps holds once settled."""
        newest = self.at_or_before(progress)
        held = [newest] if newest >= 0 else []
        while len(held) < keep and held and held[-1] > 0:
            held.append(self.before(held[-1]))
        return frozenset(s for s in held if s >= 0)

    # ---- changes ----------------------------------------------------------------------------

    def pending(self, slowest: int) -> bool:
        """True while a change announced earlier has not been reached by every rank."""
        return self.segments[-1][0] > slowest

    def switch_point(self, slowest: int, keep: int = 2) -> int:
        """The first step a new cadence may start at, given that no rank has heard of progress
        beyond ``slowest``: such a rank may capture up to the (keep-1)-th capture step after
        the newest one <= ``slowest``, then reach the next capture step and wait there at its
        window. Every step up to that one may already be decided; the next capture step not."""
        return self.after(self.at_or_before(slowest), keep + 1)

    def then(self, start: int, every: int) -> Schedule:
        """This schedule with cadence ``every`` from capture step ``start`` on."""
        if not self.is_capture(start) or start <= self.segments[-1][0]:
            raise ScheduleError(f"a new cadence must start at a capture step after {self.segments[-1][0]}, "
                                f"got {start}")
        return Schedule(self.segments + ((start, every),))

    def agrees(self, other: Schedule, upto: int) -> Optional[int]:
        """The first step <= ``upto`` on which the two schedules differ (None: none)."""
        index = 0
        for mine, theirs in zip(self.segments, other.segments):
            if mine != theirs:
                break
            index += 1
        starts = [s.segments[index][0] for s in (self, other) if index < len(s.segments)]
        if not starts or min(starts) > upto:
            return None
        step = min(starts) - 1
        for _ in range(100_000):  # identical capture steps under different segments end the search
            mine, theirs = self.after(step), other.after(step)
            if mine != theirs:
                first = min(mine, theirs)
                return first if first <= upto else None
            if mine > upto:
                return None
            step = mine
        return None


class Tuner:
    """The job's side of the cadence: the costs the ranks and node agents report, the schedule
    every rank follows, and when to change it (:meth:`retune`). ``budget`` None: the cadence stays."""

    def __init__(self, snapshot_every: int, budget: Optional[Budget]) -> None:
        self.schedule = Schedule.fixed(snapshot_every)
        self.budget = budget
        self.costs: dict[int, tuple[float, float]] = {}  # rank -> (step seconds, snapshot seconds)
        self.replication_costs: dict[int, float] = {}  # node -> CPU seconds its agent's replication takes per snapshot
        self.retune_due = False  # a cost report came while a change was still pending
        self.over_budget = False  # the replay bound keeps the cadence above the budget (warned once)

    @property
    def every(self) -> int:
        """The cadence chosen last (in force from its switch step)."""
        return self.schedule.segments[-1][1]

    def cost(self) -> float:
        """The snapshots' slowdown at the chosen cadence by the slowest figures (-1: none reported)."""
        return overhead_of(*self.slowest_costs(), self.every) if self.costs else -1.0

    def step_time(self) -> float:
        """Seconds per step by the slowest rank's smoothed figure, the one the cadence uses (-1: none reported)."""
        return self.slowest_costs()[0] if self.costs else -1.0

    def report(self, rank: int, step_time: float, capture_time: float) -> None:
        self.costs[rank] = (step_time, capture_time)

    def report_replication(self, node: int, cpu_seconds: float) -> bool:
        """A node agent's replication CPU per snapshot; True if it changed."""
        if cpu_seconds == self.replication_costs.get(node, 0.0):
            return False
        self.replication_costs[node] = max(cpu_seconds, 0.0)
        return True

    def retune(self, slowest: int) -> Optional[tuple[int, ...]]:
        """Choose the cadence from the slowest ranks' figures; the new schedule's wire form to
        announce, or None (no budget, no figures, no change worth making, one still pending).

        Every rank must switch at the same step, one no rank has decided about yet. A rank
        hears of progress only through Progress (and RESUME), and the change is broadcast
        before any Progress beyond ``slowest`` on the same ordered link, so no rank can have
        got past :meth:`Schedule.switch_point` of ``slowest`` when the change reaches it.
        """
        if self.budget is None or not self.costs:
            return None
        self._judge_budget()
        if self.schedule.pending(slowest):
            self.retune_due = True  # one change at a time: decide again once it is reached
            return None
        self.retune_due = False
        step_time, capture_time = self.slowest_costs()
        every = choose_every(step_time, capture_time, self.budget)
        current = self.every
        if every < current:  # more snapshots fit: as many as fit with headroom (see HEADROOM)
            every = choose_every(step_time, capture_time, dataclasses.replace(
                self.budget, overhead=self.budget.overhead * HEADROOM))
        if not worth_changing(current, every):
            return None
        start = self.schedule.switch_point(slowest)
        self.schedule = self.schedule.then(start, every)
        log.info("snapshot cadence %d -> every %d steps from step %d: %s (step %.4f s, snapshot %.4f s%s, slowest "
                 "ranks; budget %g, at most %d steps replayed)", current, every, start,
                 self._reason(current, every, step_time, capture_time), step_time, capture_time,
                 self._replication_part(), self.budget.overhead, self.budget.max_replay)
        return self.schedule.wire()

    def _reason(self, current: int, every: int, step_time: float, capture_time: float) -> str:
        """Why the cadence changes, for the log."""
        budget = self.budget
        cost, allowed = 100 * overhead_of(step_time, capture_time, current), 100 * budget.overhead
        if every > current:
            return f"snapshots every {current} step(s) cost {cost:.1f}% of the step, more than the {allowed:g}% allowed"
        if every < choose_every(step_time, capture_time, Budget(budget.overhead, budget.max_replay)):
            return f"Young's interval for {budget.failure_rate:g} faults per step (ATO)"
        return (f"snapshots every {current} step(s) cost {cost:.1f}% of the step, every {every} fits the "
                f"{allowed:g}% allowed ({100 * overhead_of(step_time, capture_time, every):.1f}%)")

    def _judge_budget(self) -> None:
        """Say once (until it is met again) that the replay bound, not the budget, sets the cadence."""
        budget = self.budget
        step_time, capture_time = self.slowest_costs()
        cost = overhead_of(step_time, capture_time, budget.max_replay)
        over = cost > budget.overhead
        if over and not self.over_budget:
            log.warning("snapshots cost %.1f%% of the step even every %d steps, the most a recovery may replay "
                        "(MINDFT_MAX_REPLAY_STEPS), over the %g%% budget (MINDFT_OVERHEAD_BUDGET; step %.4f s, "
                        "snapshot %.4f s%s, the slowest figures): allow more replayed steps or a larger budget",
                        100 * cost, budget.max_replay, 100 * budget.overhead, step_time, capture_time,
                        self._replication_part())
        elif self.over_budget and not over:
            log.info("snapshots fit the %g%% budget again (%.1f%% every %d steps)", 100 * budget.overhead,
                     100 * cost, budget.max_replay)
        self.over_budget = over

    def slowest_costs(self) -> tuple[float, float]:
        """The slowest step time and the slowest snapshot time (seconds): a rank's capture, plus
        the CPU the busiest node agent's replication takes per snapshot. It shares the node's cores
        with training, and a synchronous job goes at its slowest rank's pace, so all of it counts."""
        return (max(step for step, _ in self.costs.values()),
                max(capture for _, capture in self.costs.values()) + self._busiest_replication())

    def _busiest_replication(self) -> float:
        return max(self.replication_costs.values(), default=0.0)

    def _replication_part(self) -> str:
        """What of the snapshot time is the node agents' replication, for the logs ("": none)."""
        cpu = self._busiest_replication()
        return f" of which {cpu:.4f} s the busiest node's replication CPU" if cpu else ""
