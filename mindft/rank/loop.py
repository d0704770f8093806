"""The rank's coordinator seam, and mindft's coordinator: :class:`RankLoop` over the rank's processor.

:class:`~mindft.rank.engine.RankEngine` holds a :class:`Coordinator`, what decides when the rank
stops and which step it resumes from: :class:`RankLoop` over mindft's
:class:`~mindft.rank.processor.Processor` (mindft's controller), or
:class:`mindft.mindio.loop.MindioLoop` over MindIO's processor and step gate. The engine does the
work (its snapshots, restores, dumps, leaving the device) when the coordinator asks through the
rank's :class:`~mindft.flow.follower.RankHooks`.

:class:`RankLoop` joins (register; a restarted rank follows the recovery), ends each step (it asks
the follower once, :meth:`~mindft.flow.follower.Follower.end_of_step`, and carries the answer out:
the window, the capture, the step report, lockstep, a pending order), reports a fault inside a
step (or gives it up when the step keeps failing), finishes (Done, then wait for every rank).
"""
from __future__ import annotations

import logging
from typing import Callable, NoReturn, Optional, Protocol, Sequence

from mindft.exitcodes import ExitCode
from mindft.flow.follower import CostMeter, Finished, RankHooks, Resumed, joins_recovery
from mindft.flow.slow import PaceMeter
from mindft.protocol import Action, FaultKind, RegisterAck
from mindft.rank.processor import Processor, ProcessorError

log = logging.getLogger(__name__)


class GivenUp(RuntimeError):
    """The coordinator does not replay the step that faulted: the rank dumps and re-raises the
    fault. ``ends_rank``: close the rank first (MindIO's controller ends the job when this rank's
    processor says it exits)."""

    ends_rank = False


class StepKeepsFailing(GivenUp):
    """The same step failed more than ``MAX_FAULTS_PER_STEP`` times in a row: not transient."""

    def __init__(self, step: int, times: int) -> None:
        super().__init__(f"step {step} failed {times} times in a row")
        self.step = step
        self.times = times


class Coordinator(Protocol):
    """What a :class:`~mindft.rank.engine.RankEngine` asks at its step boundaries. Each call
    that may end in a recovery returns the step training resumes after (None: go straight on)."""

    def begin_step(self, step: int) -> None:
        """Before step ``step + 1``; may raise an exception for :meth:`stops` (the rank is stopped)."""

    def end_step(self, step: int, capture: Callable[[int], None]) -> Optional[int]:
        """``step`` finished: snapshot it through ``capture`` when due, tell the job, obey."""

    def stops(self, error: BaseException) -> bool:
        """True when ``error`` (out of a step) is the coordinator stopping this rank, no fault."""

    def recover(self) -> Optional[int]:
        """After :meth:`stops`: follow the recovery."""

    def fault(self, kind: FaultKind, detail: str, step: int, since: Optional[float] = None) -> Optional[int]:
        """A fault inside ``step``: report it and follow the recovery; :class:`GivenUp` when not."""

    def finish(self, step: int) -> Optional[int]:
        """Training is done at ``step``: wait for every rank (None), or the step a late fault rolled back to."""

    def report_costs(self, now: float) -> None:
        """Report what a step and a snapshot cost, when the job wants it."""

    def close(self) -> None:
        """Leave the job (idempotent)."""


class RankLoop:
    """mindft's coordinator: the driver loop over ``processor``, obeying through ``hooks`` (module docstring).

    A controller lost while the loop talks to it ends the rank through ``hooks.dump_and_exit``.
    With :attr:`lockstep` the rank waits at the end of each step until every rank finished it:
    in a job whose collectives cannot be repaired in place, a rank that faults at a step
    boundary then finds every peer at the same boundary (not blocked in the next step's
    all-reduce), so the recovery rolls back in place instead of restarting every worker.
    :attr:`interruption` is an order that stopped a step before its collectives (the MindSpore
    session's gate): the step's exception is then no fault, the rank obeys the order.
    """

    def __init__(self, processor: Processor, hooks: RankHooks) -> None:
        self.processor = processor
        self.hooks = hooks
        self.rank = processor.rank
        self.lockstep = False
        self.finished_job = False  # FINISH received: every rank is done
        self.interruption: Optional[Action] = None
        self.costs = CostMeter()
        self.pace: Optional[PaceMeter] = None  # own work per step, reported for slow ranks (the engine's)

    def join(self, held: Sequence[int], restarted: bool, adopted: bool = True, collectives: bool = False) -> bool:
        """:meth:`register`, then :meth:`rejoin`: True when the rank followed a recovery."""
        return self.rejoin(self.register(held, collectives), restarted, adopted, held)

    def register(self, held: Sequence[int], collectives: bool = False) -> RegisterAck:
        """Register with the steps ``held`` and wait at the start barrier (a restarted rank is
        answered at once). Exits FAILED when the controller never answers or ends the job."""
        try:
            return self.processor.register(held_steps=held, collectives=collectives)
        except ProcessorError as error:
            log.critical("%s", error)
            self.processor.close()
            raise SystemExit(ExitCode.FAILED) from None

    def rejoin(self, ack: RegisterAck, restarted: bool, adopted: bool, held: Sequence[int]) -> bool:
        """A restarted rank that holds state of its own (``adopted``), or finds the job
        recovering, follows the recovery until RESUME. True when it did."""
        if not joins_recovery(restarted, adopted, ack.state):
            return False
        log.warning("rank=%d restarted holding %s; waiting for ROLLBACK", self.rank, list(held))
        self.follow()
        return True

    def follow(self, action: Optional[Action] = None) -> Optional[int]:
        """Obey the controller from ``action`` (or the next one) until training may go on.

        Returns the step training resumes after (a RESUME), or None when an injected fault was
        armed outside a recovery or the job finished (:attr:`finished_job` tells which).
        """
        processor = self.processor
        try:
            while True:
                if action is None:
                    action = processor.wait_action()
                log.info("rank=%d %s step=%d round=%d", self.rank, action.kind.name, action.step, action.round)
                with processor.report_lock:  # not held while the hooks run: the replication's thread releases
                    processor.follower.forget_reports()
                ack, outcome = processor.follower.obey(action, self.hooks)
                if ack is not None:
                    processor.send(ack)
                if isinstance(outcome, Resumed):
                    return outcome.step
                if isinstance(outcome, Finished):
                    self.finished_job = True
                    return None
                if outcome is not None:
                    return None
                action = None
        except ProcessorError as error:
            self._give_up(str(error))

    def begin_step(self, step: int) -> None:
        """Nothing to ask before a step: an order is obeyed at a step's end (or at the gate)."""

    def end_step(self, step: int, capture: Callable[[int], None]) -> Optional[int]:
        """The end of ``step``: ask the follower once (:meth:`~mindft.flow.follower.Follower.end_of_step`)
        and carry its answer out, in order: wait for the window, ``capture(step)``, report the
        step, hold for the peers or obey a pending order. Returns the step a recovery rolled
        training back to (or resumed after), None to go straight on."""
        processor = self.processor
        plan = processor.follower.end_of_step(step, self.lockstep)
        try:
            if plan.await_window:
                while (action := processor.wait_window(step)) is not None:
                    resumed = self.follow(action)
                    if resumed is not None:
                        return resumed
            if plan.capture:
                capture(step)
            processor.finished(step)
            if plan.hold:
                while (action := processor.wait_peers(step)) is not None:
                    resumed = self.follow(action)
                    if resumed is not None:
                        return resumed
                return None
            action = processor.poll_action()
        except ProcessorError as error:
            self._give_up(str(error))
        return None if action is None else self.follow(action)

    def _give_up(self, reason: str) -> NoReturn:
        """The job is out of reach: the dying gasp of the step every rank holds, as last heard
        (its newest when it no longer holds that one: no progress was heard before the loss)."""
        step = self.processor.follower.orphan_step()
        self.hooks.dump_and_exit(step if step in self.hooks.settle() else -1, reason)

    def stops(self, error: BaseException) -> bool:
        """True when an order interrupted the step (:attr:`interruption`): no fault to report."""
        return self.interruption is not None

    def recover(self) -> Optional[int]:
        """Obey the order that interrupted the step."""
        action, self.interruption = self.interruption, None
        return self.follow(action)

    def fault(self, kind: FaultKind, detail: str, step: int, since: Optional[float] = None) -> Optional[int]:
        """A fault of ``kind`` inside ``step``, caught at ``since`` (``time.monotonic()``; default:
        now): report it and follow the recovery. Returns what :meth:`follow` returns; raises
        :class:`StepKeepsFailing` instead of replaying a step yet again."""
        follower = self.processor.follower
        if not follower.on_fault(step):
            raise StepKeepsFailing(step, follower.faults_in_a_row - 1)
        log.warning("rank=%d fault %s inside step %d: %s", self.rank, kind.name, step, detail)
        try:
            self.processor.report_fault(kind, detail, step, since)
        except ProcessorError as lost:
            self._give_up(f"lost the controller while reporting {kind.name}: {lost}")
        return self.follow()

    def finish(self, step: int) -> Optional[int]:
        """Report Done at ``step`` and wait for every rank: None when the job is finished, or
        the step to continue training after when a late fault rolled everyone back."""
        try:
            self.processor.done(step)
        except ProcessorError as error:
            self._give_up(str(error))
        while not self.finished_job:
            resumed = self.follow()
            if resumed is not None:
                return resumed
        return None

    def report_costs(self, now: float) -> None:
        """Report the measured costs when the job chooses the cadence and they are worth it, and
        this rank's pace when due."""
        figures = self.costs.due(now) if self.processor.reports_costs else None
        pace = self.pace.due(now) if self.pace is not None else None
        try:
            if figures is not None:
                self.processor.report_cost(*figures)
            if pace is not None:
                self.processor.report_pace(*pace)
        except ProcessorError:
            pass  # the next end_step finds the controller lost

    def close(self) -> None:
        """Close the processor (idempotent)."""
        self.processor.close()
