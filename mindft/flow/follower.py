"""The rank side of the flow as a plain object: an action in, a command out.

:meth:`Follower.obey` carries a command out through the rank's :class:`RankHooks` and says
whether training may go on. The processor (``mindft.processor.Processor.follow``) feeds it
actions from the socket; the simulated jobs of the tests feed it from queues. The MindSpore
session, the test ranks and the benchmarks are all RankHooks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, Optional, Protocol, Sequence, Union

from mindft.flow.cadence import Schedule
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

    @property
    def snapshot_every(self) -> int:
        """The cadence in force at the next step."""
        return self.schedule.every_at(self.position + 1)

    def is_capture_step(self, step: int) -> bool:
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

    def on_progress(self, step: int) -> None:
        if step > self.slowest:
            self.slowest = step

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

