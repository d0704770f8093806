"""The rank side of the flow as a plain object: an action in, a command out.

:meth:`Follower.obey` carries a command out through the rank's :class:`RankHooks` and says
whether training may go on. The rank's loop (``mindft.rank.loop.RankLoop.follow``) feeds it
actions from the processor's socket; the simulated jobs of the tests feed it from queues. The
rank engine (for the MindSpore session, the fake test rank, the benchmarks) is the RankHooks.

At the end of each step the rank asks once, :meth:`Follower.end_of_step`, and carries the one
answer (:class:`StepEnd`) out: wait for the window, capture, report, hold for the peers or obey.
The rank's other rules live here too: which step report may go now (:meth:`Follower.report`,
held back until its replica arrived), when a step that keeps failing is given up
(:meth:`Follower.on_fault`), and when the measured costs are worth reporting (:class:`CostMeter`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, Optional, Protocol, Sequence, Tuple, Union

from mindft.flow.cadence import Schedule, WarmMean
from mindft.protocol import Ack, Action, ActionKind, FaultKind, StepReport


@dataclass(frozen=True)
class Settle:
    """Let the snapshot in flight finish, then acknowledge PAUSE with the steps held."""


@dataclass(frozen=True)
class Restore:
    """Restore the snapshot of ``step`` in place, then acknowledge."""

    step: int


@dataclass(frozen=True)
class Resume:
    """Acknowledge and continue training after ``step`` (restore it first if not there yet)."""

    step: int


@dataclass(frozen=True)
class DumpAndExit:
    """Write the dying-gasp checkpoint of ``step`` (-1: the newest held) and exit."""

    step: int
    reason: str


@dataclass(frozen=True)
class LeaveDevice:
    """Exit the process so the device can be hot-reset (the snapshots stay with the node agent)."""

    reason: str


@dataclass(frozen=True)
class ArmFault:
    """Raise ``fault`` at the next step boundary (fault injection)."""

    fault: FaultKind
    detail: str


@dataclass(frozen=True)
class Leave:
    """Every rank finished: close and return normally."""

    step: int


@dataclass(frozen=True)
class Ignore:
    """Nothing to do (an action of an abandoned round)."""

    reason: str


Command = Union[Settle, Restore, Resume, DumpAndExit, LeaveDevice, ArmFault, Leave, Ignore]


@dataclass(frozen=True)
class Resumed:
    """Outcome: the recovery is over; train on after ``step``."""

    step: int


@dataclass(frozen=True)
class Armed:
    """Outcome: an injected fault is armed; train on (it fires at the next step boundary)."""


@dataclass(frozen=True)
class Finished:
    """Outcome: every rank finished; leave."""


Outcome = Union[Resumed, Armed, Finished]


@dataclass(frozen=True)
class StepEnd:
    """The follower's one answer at the end of ``step`` (:meth:`Follower.end_of_step`): what the
    rank carries out, in this order.

    1. ``await_window``: the window is closed; wait until the slowest rank's progress opens it
       (:meth:`Follower.may_capture`), obeying any order that comes first;
    2. ``capture``: snapshot ``step`` (a capture step of the schedule);
    3. report ``step`` finished (the report :meth:`Follower.report` lets go);
    4. ``hold``: lockstep; wait until every rank finished ``step``, obeying any order that comes
       first. Otherwise obey the order pending, if any.
    """

    step: int
    capture: bool = False
    await_window: bool = False
    hold: bool = False

# A step that faults this many times in a row is not a transient device fault: stop replaying it.
MAX_FAULTS_PER_STEP = 3
# The measured costs the job chooses the cadence from: smoothed with this weight per sample, the
# first (cold) sample of each left out (WarmMean), reported when one moves by more than
# COST_CHANGE (relative), or when a snapshot's share of a step (capture / step, what the cadence
# follows) rises by more than COST_RISE: the cadence may then be over the budget. At most every
# COST_REPORT_INTERVAL s.
COST_SMOOTHING = 0.3
COST_CHANGE = 0.2
COST_RISE = 0.05
COST_REPORT_INTERVAL = 1.0
# Controller states in which a restarted rank that holds nothing may simply start training.
_RUNNING_STATES = ("STARTING", "NORMAL")


@dataclass
class StepFaults:
    """How many times in a row the same step failed: past MAX_FAULTS_PER_STEP it is no transient
    device fault, and the rank stops replaying it (mindft's ranks and MindIO's alike)."""

    step: int = -1
    count: int = 0

    def add(self, step: int) -> bool:
        """A fault inside ``step``: True while it may be replayed."""
        self.count = self.count + 1 if step == self.step else 1
        self.step = step
        return self.count <= MAX_FAULTS_PER_STEP


def joins_recovery(restarted: bool, adopted: bool, job_state: str) -> bool:
    """Whether a rank that just registered follows a recovery (waits for ROLLBACK) instead of
    training from its start: a restarted rank does when it holds state of its own (``adopted``:
    from the node agent's memory or its buddy's replica), or when the job is not running."""
    return restarted and (adopted or job_state.upper() not in _RUNNING_STATES)


class RankHooks(Protocol):
    """What a rank does when the flow asks (the session's snapshots, or a test rank's)."""

    def settle(self) -> Sequence[int]:
        """Finish the snapshot in flight; return the steps held."""

    def restore(self, step: int) -> Sequence[int]:
        """Put the state of ``step`` back in place; return the steps held."""

    def resume(self, step: int) -> None:
        """Training goes on after ``step`` once this returns."""

    def arm(self, fault: FaultKind, detail: str) -> None:
        """Raise ``fault`` at the next step boundary."""

    def dump_and_exit(self, step: int, reason: str) -> NoReturn:
        """Write the dying-gasp checkpoint of ``step`` (-1: newest) and end the process."""

    def leave_device(self, reason: str) -> NoReturn:
        """End the process so its device can be reset; its snapshots must outlive it."""


class Follower:
    """One rank's view of the flow: its progress, the recovery round, the slowest rank.

    The :class:`~mindft.flow.cadence.Schedule` (every ``snapshot_every``-th step until the
    job announces another) and ``keep`` (snapshots held) define the window: a rank may
    overwrite its oldest snapshot by capturing ``step`` only once every rank has finished
    the (keep - 1)-th capture step before it, so some step is always held by every rank.
    """

    def __init__(self, rank: int, snapshot_every: int = 1, keep: int = 2) -> None:
        if snapshot_every < 1 or keep < 2:
            raise ValueError(f"need snapshot_every >= 1 and keep >= 2, got {snapshot_every}, {keep}")
        self.rank = rank
        self.schedule = Schedule.fixed(snapshot_every)
        self.keep = keep
        self.position = 0    # steps this rank has finished
        self.deciding = 0    # the newest step whose capture this rank decided (it may wait at its window)
        self.slowest = 0     # the step every rank has finished, as last heard
        self.round = 0
        self.recovering = False
        self.reported: Tuple[int, int] = (-1, -1)  # (round, step) of the newest step report sent
        self._faults = StepFaults()

    @property
    def snapshot_every(self) -> int:
        """The cadence in force at the next step."""
        return self.schedule.every_at(self.position + 1)

    def end_of_step(self, step: int, lockstep: bool = False) -> StepEnd:
        """This rank finished training ``step``: what to do before the next one (:class:`StepEnd`).
        ``lockstep``: the rank holds at every step's end until every rank finished it."""
        capture = self.is_capture_step(step)
        return StepEnd(step, capture, capture and not self.may_capture(step), lockstep)

    def is_capture_step(self, step: int) -> bool:
        """Whether ``step`` is snapshotted; it is decided from now on (a new cadence spares it)."""
        self.deciding = max(self.deciding, step)
        return self.schedule.is_capture(step)

    def may_capture(self, step: int) -> bool:
        """True when capturing ``step`` keeps a step that every rank holds."""
        return self.slowest >= self.schedule.before(step, self.keep - 1)

    def on_cadence(self, schedule: Schedule) -> Optional[int]:
        """The job's schedule replaces this rank's. Returns the first step this rank already
        decided differently (None: none, the normal case; the job never announces that)."""
        differs = schedule.agrees(self.schedule, max(self.deciding, self.position))
        self.schedule = schedule
        return differs

    def finished(self, step: int) -> StepReport:
        """This rank finished ``step``: the fire-and-forget report to send."""
        self.position = step
        return StepReport(self.rank, step, self.round)

    def report(self, step: int, limit: Optional[int] = None) -> Optional[StepReport]:
        """This rank finished ``step``: the report to send now, or None when there is nothing
        new to say. ``limit`` caps the step a report may claim: a rank that replicates its own
        snapshots reports a capture step only once its replica arrived (then :meth:`release`)."""
        self.finished(step)
        return self._reportable(step, limit)

    def release(self, limit: int) -> Optional[StepReport]:
        """The report limit rose to ``limit``: the report it now allows, if any. None while
        recovering: the recovery decides where every rank is; reports resume after RESUME."""
        if self.recovering:
            return None
        return self._reportable(self.position, limit)

    def forget_reports(self) -> None:
        """An action arrived: it may move every rank's progress, so the next report goes whatever
        was reported before (call before :meth:`obey`)."""
        self.reported = (-1, -1)

    def _reportable(self, step: int, limit: Optional[int]) -> Optional[StepReport]:
        if limit is not None:
            step = min(step, limit)
        if (self.round, step) <= self.reported:
            return None
        self.reported = (self.round, step)
        return StepReport(self.rank, step, self.round)

    def on_fault(self, step: int) -> bool:
        """A fault inside ``step``: True to report it and replay, False to give up (:class:`StepFaults`)."""
        return self._faults.add(step)

    @property
    def faults_in_a_row(self) -> int:
        """How many times in a row the step of the newest fault failed."""
        return self._faults.count

    def on_progress(self, step: int) -> None:
        if step > self.slowest:
            self.slowest = step

    def orphan_step(self) -> int:
        """The step to dump when the job can no longer name one (its controller or its node agent
        lost): the newest capture at or before the step every rank finished, as last heard, which
        the window keeps held by every rank, so that every rank orphaned alike dumps the same step."""
        return self.schedule.at_or_before(self.slowest)

    def on_action(self, action: Action) -> Command:
        """What ``action`` asks of this rank."""
        kind = action.kind
        if kind is ActionKind.INJECT_FAULT:
            return ArmFault(action.fault or FaultKind.UCE, action.reason or "injected by the controller")
        if kind is ActionKind.DUMP_AND_EXIT:
            return DumpAndExit(action.step, action.reason)
        if kind is ActionKind.FINISH:
            return Leave(action.step)
        if kind is ActionKind.LEAVE_DEVICE:
            return LeaveDevice(action.reason)
        if action.round < self.round:
            return Ignore(f"{kind.name} of round {action.round}; the current round is {self.round}")
        self.round = action.round
        if kind is ActionKind.PAUSE:
            self.recovering = True
            return Settle()
        if kind is ActionKind.ROLLBACK:
            return Restore(action.step)
        if kind is ActionKind.RESUME:
            self.recovering = False
            self.slowest = action.step
            return Resume(action.step)
        return Ignore(f"unexpected action {kind.name}")

    def obey(self, action: Action, hooks: RankHooks) -> tuple[Optional[Ack], Optional[Outcome]]:
        """Carry ``action`` out through ``hooks``: the acknowledgement to send (if any), and the
        outcome (None: keep waiting for the next action)."""
        command = self.on_action(action)
        kind = type(command)
        if kind is Settle:
            return self._ack(ActionKind.PAUSE, self.position, hooks.settle()), None
        if kind is Restore:
            held = hooks.restore(command.step)
            self.position = self.deciding = command.step
            return self._ack(ActionKind.ROLLBACK, command.step, held), None
        if kind is Resume:
            if self.position != command.step:  # joined after this round's ROLLBACK
                hooks.restore(command.step)
            hooks.resume(command.step)
            self.position = self.deciding = command.step
            return self._ack(ActionKind.RESUME, command.step, ()), Resumed(command.step)
        if kind is DumpAndExit:
            hooks.dump_and_exit(command.step, command.reason)
        if kind is LeaveDevice:
            hooks.leave_device(command.reason)
        if kind is ArmFault:
            hooks.arm(command.fault, command.detail)
            return None, None if self.recovering else Armed()
        if kind is Leave:
            return None, Finished()
        return None, None

    def _ack(self, kind: ActionKind, step: int, held: Sequence[int]) -> Ack:
        return Ack(self.rank, kind, step, tuple(sorted(held)), self.round)



class CostMeter:
    """What a training step and a snapshot cost this rank, smoothed, and when to report them.
    The first sample of each is cold (a first snapshot into fresh memory, a first push with its
    connection's set-up) and left out: nothing is reported before a warm one of each."""

    def __init__(self) -> None:
        self.steps = WarmMean(COST_SMOOTHING)
        self.captures = WarmMean(COST_SMOOTHING)
        self._sent: Optional[Tuple[float, float]] = None
        self._sent_at = -1e9

    @property
    def step_time(self) -> Optional[float]:
        """Seconds a training step takes, smoothed (None: no warm sample yet)."""
        return self.steps.value

    @property
    def capture_time(self) -> Optional[float]:
        """Seconds a snapshot takes, smoothed (None: no warm sample yet)."""
        return self.captures.value

    def step(self, seconds: float) -> None:
        """A training step took ``seconds`` (not counting a wait for a capture)."""
        self.steps.add(max(seconds, 0.0))

    def capture(self, seconds: float) -> None:
        """A snapshot (its copy and its replication's CPU) took ``seconds``."""
        self.captures.add(max(seconds, 0.0))

    def due(self, now: float) -> Optional[Tuple[float, float]]:
        """The figures (step, capture seconds) to report at ``now``, if any (then they count as sent)."""
        step_time, capture_time = self.step_time, self.capture_time
        if step_time is None or capture_time is None:
            return None
        figures = (step_time, capture_time)
        if self._sent is not None:
            if now - self._sent_at < COST_REPORT_INTERVAL:
                return None
            moved = any(abs(new - old) > COST_CHANGE * old for new, old in zip(figures, self._sent))
            if not moved and share(*figures) <= share(*self._sent) * (1 + COST_RISE):
                return None
        self._sent, self._sent_at = figures, now
        return figures


def share(step_time: float, capture_time: float) -> float:
    """A snapshot's cost in steps' time (what the budget's cadence is proportional to)."""
    return capture_time / step_time if step_time > 0 else float("inf")
