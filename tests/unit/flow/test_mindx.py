"""MindX's rules for MindIO's controller (mindft.flow.mindx): tables of inputs → decisions, then seeded schedules.

The shell that feeds them (threads, the step gate, the launcher's processes) is in
tests/unit/mindio/test_mindio_standin.py; the real wheel drives both in tests/integration/mindio/test_mindio_backend.py.
"""
from __future__ import annotations

import logging
import random
from typing import Optional

import pytest

from mindft.flow.effects import KillRank, StartRank
from mindft.flow.inputs import DeviceFailed, DeviceFaulty, DeviceRecovered, RollbackAll, StopJob
from mindft.flow.mindx import (MINDX_PROCESS_ERROR, MINDX_UCE_ERROR, PHASE_TRANSITIONS, START_GRACE, ChangeStrategy,
                               ConfirmRanks, Device, ElegantDump, Fail, FaultRanks, HoldGate, LeaveGate, MindX, Phase,
                               RejoinGate, ReleaseGate, Reset, Result, Step, StopComplete, Strategies, StopTrain, Tick,
                               next_phase)
from mindft.flow.states import IllegalTransition

P, PE = MINDX_PROCESS_ERROR, MINDX_UCE_ERROR
ARF = ("exit", "dump", "recover")
LEAVE, GATHER, REPAIR = 30.0, 60.0, 180.0
NOT_LEFT = ("did not leave its chip within 30 s (the device plugin resets a chip only once its processes "
            "are gone)")


def fresh() -> MindX:
    return MindX(leave_timeout=LEAVE, gather_timeout=GATHER, repair_timeout=REPAIR)


def feed(m: MindX, *inputs) -> list:
    return [decision for event in inputs for decision in m.handle(event)]


def reset_gathered(m: MindX, rank: int = 1, now: float = 0.0) -> list:
    """Rank ``rank``'s chip goes into a reset; the ranks gather at step 7: the decisions on the way."""
    return feed(m, Device(DeviceFaulty(rank, "0x80E01801", "reset"), now), Tick(now + 0.1, joined=True),
                Tick(now + 0.2, gathered=7))


def controller_stops(m: MindX, errors: dict, offered=ARF, now: float = 1.0) -> list:
    """What MindIO's controller does after a stop_train, as in controller.cpp."""
    return feed(m, FaultRanks(errors, now), StopComplete(0, "stop ok", errors, now), FaultRanks(errors, now),
                Strategies(errors, tuple(offered), now))


# ---- the tables ---------------------------------------------------------------------------------

@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("step", list(Step))
def test_every_phase_and_step_either_moves_as_the_table_says_or_raises(phase: Phase, step: Step) -> None:
    expected = PHASE_TRANSITIONS.get((phase, step))
    if expected is None:
        with pytest.raises(IllegalTransition, match=f"no transition from {phase.value} on {step.value}"):
            next_phase(phase, step)
    else:
        assert next_phase(phase, step) is expected


@pytest.mark.parametrize("source, step, target", [
    (Phase.IDLE, Step.STOP, Phase.STOPPING),
    (Phase.STOPPING, Step.STOPPED, Phase.CHOOSING),
    (Phase.CHOOSING, Step.REPAIR, Phase.REPAIRING),
    (Phase.REPAIRING, Step.REPAIRED, Phase.IDLE),
    (Phase.IDLE, Step.END, Phase.ENDED),
    (Phase.REPAIRING, Step.END, Phase.ENDED),
    (Phase.ENDED, Step.END, Phase.ENDED),
])
def test_the_episode_table(source: Phase, step: Step, target: Phase) -> None:
    assert next_phase(source, step) is target


@pytest.mark.parametrize("phase, event", [
    (Phase.IDLE, StopComplete(0, "ok", {1: P}, 0.0)),        # a stop nobody asked for
    (Phase.IDLE, Strategies({1: P}, ("retry",), 0.0)),       # strategies before a stop
    (Phase.STOPPING, Strategies({1: P}, ("retry",), 0.0)),   # strategies before the stop completed
    (Phase.REPAIRING, StopComplete(0, "ok", {1: P}, 0.0)),
    (Phase.ENDED, Strategies({1: P}, ("retry",), 0.0)),
])
def test_callbacks_out_of_order_raise_and_change_nothing(phase: Phase, event) -> None:
    m = fresh()
    m.phase = phase
    with pytest.raises(IllegalTransition):
        m.handle(event)
    assert m.phase is phase and m.strategy is None and m.failed is None


@pytest.mark.parametrize("failed, on_reset_chip, offered, choice, phase", [
    (False, False, ("exit", "dump", "retry", "recover"), "retry", Phase.REPAIRING),   # a UCE, repaired in place
    (False, False, ARF, "dump", Phase.ENDED),            # a lost process: not restarted on this backend
    (False, False, ("exit",), "exit", Phase.ENDED),
    (False, True, ARF, "recover", Phase.REPAIRING),       # a chip's reset: ARF takes the rank back
    (False, True, ("exit", "dump", "retry"), "dump", Phase.ENDED),  # no ARF: the reset rank cannot come back
    (False, True, ("exit",), "exit", Phase.ENDED),
    (True, False, ("exit", "dump", "retry"), "dump", Phase.ENDED),  # the job failed already
    (True, True, ARF, "dump", Phase.ENDED),
    (True, False, ("exit", "retry"), "exit", Phase.ENDED),
])
def test_the_strategy_table(failed: bool, on_reset_chip: bool, offered, choice: str, phase: Phase) -> None:
    m = fresh()
    m.phase, m.failed = Phase.CHOOSING, ("earlier failure" if failed else None)
    if on_reset_chip:
        m._begin_reset(1, 0.0)
    assert m.handle(Strategies({1: P}, offered, 1.0)) == [ChangeStrategy(choice)]
    assert m.phase is phase and m.strategy == choice
    assert (m.failed is not None) == (phase is Phase.ENDED)


@pytest.mark.parametrize("source, target", [
    (Reset.GATHERING, Reset.LEAVING), (Reset.GATHERING, Reset.STARTING), (Reset.QUEUED, Reset.LEFT),
    (Reset.LEFT, Reset.LEAVING), (Reset.STARTING, Reset.LEFT),
])
def test_illegal_moves_of_a_ranks_reset_raise(source: Reset, target: Reset) -> None:
    m = fresh()
    m._begin_reset(1, 0.0)
    m.resets[1].state = source
    with pytest.raises(IllegalTransition, match="rank 1's reset cannot go"):
        m._set(m.resets[1], target, 1.0)


# ---- episodes, input by input ---------------------------------------------------------------------

def test_a_hot_reset_goes_through_mindio_arf_and_restarts_the_rank_once_its_process_is_gone() -> None:
    m = fresh()
    assert feed(m, Device(DeviceFaulty(1, "0x80E01801", "reset"), 0.0)) == []
    assert m.off_device == (1,) and m.phase is Phase.IDLE
    assert feed(m, Tick(0.1, joined=False)) == []  # MindIO knows no rank before every rank asked the gate
    assert feed(m, Tick(0.2, joined=True)) == [HoldGate()]
    assert feed(m, Tick(0.3, gathered=None)) == []
    assert feed(m, Tick(0.4, gathered=7)) == [StopTrain({1: P}), LeaveGate(1)]
    assert m.phase is Phase.STOPPING and m.watched == (1,)
    assert controller_stops(m, {1: P}) == [ConfirmRanks({1: P}), ChangeStrategy("recover")]
    assert m.phase is Phase.REPAIRING
    assert feed(m, Tick(2.0, running=frozenset({1}))) == []   # still leaving
    assert feed(m, Tick(3.0)) == []                           # gone: left, waits for the chip
    assert m.resets[1].state is Reset.LEFT and m.watched == ()
    assert feed(m, Device(DeviceRecovered(1), 50.0)) == []
    assert feed(m, Tick(50.1)) == [RejoinGate(1), ReleaseGate(), StartRank(1, "its chip was reset (recovered)")]
    assert m.off_device == () and not m.holding
    assert feed(m, Result(0, "Mindio do repair operation ok", "recover", 60.0)) == []
    assert m.phase is Phase.IDLE and m.failed is None


@pytest.mark.parametrize("ticks, killed, started", [
    ([(6.0, {1})], False, False),                            # the old process still runs: no start yet
    ([(6.0, {1}), (7.0, set())], False, True),               # once it is gone
    ([(0.2 + LEAVE, {1})], True, False),                     # not gone in time: killed...
    ([(0.2 + LEAVE, {1}), (0.3 + LEAVE, set())], True, True),  # ...and started once gone
])
def test_a_rank_whose_chip_is_back_before_it_left_is_started_once_its_old_process_is_gone(
        ticks, killed: bool, started: bool) -> None:
    m = fresh()
    reset_gathered(m)  # told to leave at 0.2
    assert feed(m, Device(DeviceRecovered(1), 5.0)) == []
    decisions = feed(m, *(Tick(t, running=frozenset(r)) for t, r in ticks))
    assert (StartRank(1, "its chip was reset (recovered)") in decisions) is started
    assert (KillRank(1, 0, NOT_LEFT, restart=False) in decisions) is killed


@pytest.mark.parametrize("alive_at_deadline, killed", [(True, True), (False, False)])
def test_a_rank_that_does_not_leave_its_chip_is_killed(alive_at_deadline: bool, killed: bool) -> None:
    m = fresh()
    reset_gathered(m)  # told to leave at 0.2
    assert feed(m, Tick(0.2 + LEAVE - 0.01, running=frozenset({1}))) == []
    running = frozenset({1}) if alive_at_deadline else frozenset()
    decisions = feed(m, Tick(0.2 + LEAVE, running=running))
    assert decisions == ([KillRank(1, 0, NOT_LEFT, restart=False)] if killed else [])
    assert m.resets[1].state is Reset.LEFT


def test_a_failed_chip_turns_the_arf_wait_into_a_dump_and_nothing_starts_after() -> None:
    m = fresh()
    reset_gathered(m)
    controller_stops(m, {1: P})
    feed(m, Tick(2.0))
    decisions = feed(m, Device(DeviceFailed(1, "status failed, policy isolate"), 3.0))
    assert decisions == [Fail("rank 1's chip failed the hot reset (status failed, policy isolate)"),
                         ChangeStrategy("dump")]
    assert feed(m, Result(0, "do dump success", "dump", 4.0)) == [] and m.phase is Phase.ENDED
    assert feed(m, Device(DeviceRecovered(1), 5.0), Tick(5.1), Tick(100.0)) == []  # too late: the job is over
    assert m.next_wake() is None and not m.polling


def test_a_chip_that_fails_before_the_stop_is_gathered_stopped_and_dumped() -> None:
    m = fresh()
    assert feed(m, Device(DeviceFailed(0, "policy isolate"), 0.0)) == [Fail("rank 0's chip failed the hot reset "
                                                                            "(policy isolate)")]
    assert feed(m, Tick(0.1), Tick(0.2, gathered=7)) == [HoldGate(), StopTrain({0: P}), LeaveGate(0)]
    assert controller_stops(m, {0: P})[-1] == ChangeStrategy("dump") and m.phase is Phase.ENDED


def test_faults_mindio_reports_itself_are_retried_in_place_or_dumped() -> None:
    m = fresh()
    assert feed(m, FaultRanks({1: PE}, 0.0)) == [StopTrain({1: PE})]
    assert controller_stops(m, {1: PE}, ("exit", "dump", "retry", "recover"))[-1] == ChangeStrategy("retry")
    assert feed(m, Result(0, "Mindio do repair operation ok", "retry", 2.0)) == [] and m.phase is Phase.IDLE
    # A process lost without a reset of its chip: mindft-launch does not restart it on MindIO.
    assert feed(m, FaultRanks({0: P}, 3.0)) == [StopTrain({0: P})]
    assert controller_stops(m, {0: P})[-1] == ChangeStrategy("dump")
    assert m.phase is Phase.ENDED and m.failed == "MindIO cannot repair ranks [0] (dump)"


@pytest.mark.parametrize("phase, decisions, after", [
    (Phase.IDLE, [HoldGate(), ElegantDump()], Phase.IDLE),   # MindIO's own "elegant dump"
    (Phase.STOPPING, [], Phase.STOPPING),                    # the strategy chosen next is dump
    (Phase.CHOOSING, [], Phase.CHOOSING),
])
def test_volcanos_graceful_exit_dumps(phase: Phase, decisions: list, after: Phase) -> None:
    m = fresh()
    m.phase = phase
    reason = "Volcano asked every training process to exit (GracefulExit)"
    assert feed(m, Device(StopJob(reason), 0.0)) == [Fail(reason), *decisions]
    assert m.phase is after and m.failed == reason
    assert feed(m, Device(StopJob("again"), 1.0)) == []  # the first reason stays


def test_the_ranks_are_stopped_where_they_are_when_they_do_not_gather() -> None:
    m = fresh()
    feed(m, Device(DeviceFaulty(1, "0x1", "reset"), 0.0))
    assert feed(m, Tick(GATHER - 1, joined=False)) == []
    assert feed(m, Tick(GATHER, joined=False)) == [HoldGate(), StopTrain({1: P}), LeaveGate(1)]


@pytest.mark.parametrize("result_at, tick_at, expected", [
    (5.0, None, [StopTrain({1: P}), LeaveGate(1)]),   # the episode in MindIO's hands ends: the reset goes on
    (None, 0.2 + REPAIR, [LeaveGate(1)]),              # it does not end in time: the rank leaves anyway
])
def test_a_reset_waits_for_the_episode_mindio_is_in(result_at, tick_at, expected) -> None:
    m = fresh()
    feed(m, FaultRanks({0: PE}, 0.0))
    controller_stops(m, {0: PE}, ("retry",), now=0.0)
    assert m.phase is Phase.REPAIRING
    assert reset_gathered(m) == [HoldGate()]  # gathered, queued
    assert m.resets[1].state is Reset.QUEUED
    if result_at is not None:
        assert feed(m, Result(0, "ok", "retry", result_at)) == expected
    else:
        assert feed(m, Tick(tick_at - 0.01)) == []
        assert feed(m, Tick(tick_at)) == expected


def test_a_chip_not_recovered_in_time_fails_the_job() -> None:
    m = fresh()
    reset_gathered(m)  # left at 0.2
    controller_stops(m, {1: P})
    assert m.next_wake() == pytest.approx(0.2 + LEAVE)
    feed(m, Tick(1.0))  # gone
    assert m.next_wake() == pytest.approx(0.2 + REPAIR) and not m.polling
    assert feed(m, Tick(0.2 + REPAIR)) == [Fail(f"rank 1's chip was not recovered within {REPAIR:g} s"),
                                           ChangeStrategy("dump")]
    assert m.next_wake() is None


def test_a_chip_recovered_before_its_rank_left_still_has_it_leave_then_start() -> None:
    m = fresh()
    feed(m, Device(DeviceFaulty(1, "0x1", "reset"), 0.0), Tick(0.1))
    assert feed(m, Device(DeviceRecovered(1), 0.2)) == []
    assert feed(m, Tick(0.3, gathered=7)) == [StopTrain({1: P}), LeaveGate(1)]  # MindIO counts it as faulty
    assert feed(m, Tick(0.4, running=frozenset({1}))) == []
    assert feed(m, Tick(0.3 + LEAVE, running=frozenset({1}))) == [KillRank(1, 0, NOT_LEFT, restart=False)]
    assert m.resets[1].state is Reset.STARTING
    assert feed(m, Tick(0.4 + LEAVE)) == [RejoinGate(1), ReleaseGate(), StartRank(1, "its chip was reset (recovered)")]


@pytest.mark.parametrize("setup, event", [
    ("ended", Device(DeviceFaulty(1, "0x1", "reset"), 1.0)),   # the job is over
    ("resetting", Device(DeviceFaulty(1, "0x1", "reset"), 1.0)),  # already in a reset
    ("idle", Device(DeviceRecovered(1), 1.0)),                  # not in a reset
    ("idle", Device(RollbackAll("clusterd reported a fault of rank 1", 1), 1.0)),  # not acted on on MindIO
    ("stopping", FaultRanks({1: PE}, 1.0)),                      # MindIO's second report of an episode
])
def test_inputs_that_change_nothing(setup: str, event, caplog: pytest.LogCaptureFixture) -> None:
    m = fresh()
    if setup == "ended":
        m.phase = Phase.ENDED
    elif setup == "resetting":
        feed(m, Device(DeviceFaulty(1, "0x1", "reset"), 0.0))
    elif setup == "stopping":
        m.phase = Phase.STOPPING
    before = (m.phase, m.failed, m.off_device)
    assert m.handle(event) == []
    assert (m.phase, m.failed, m.off_device) == before
    if isinstance(event, Device) and isinstance(event.event, RollbackAll):
        assert "is not acted on with MINDFT_BACKEND=mindio" in caplog.text


@pytest.mark.parametrize("event, failed", [
    (StopComplete(3, "stop timeout", {1: PE}, 1.0), "MindIO could not stop the job: stop timeout"),
])
def test_mindio_failing_to_stop_ends_the_job(event, failed: str) -> None:
    m = fresh()
    feed(m, FaultRanks({1: PE}, 0.0))
    assert m.handle(event) == [] and m.phase is Phase.ENDED and m.failed == failed


def test_a_failed_repair_asks_for_a_dump() -> None:
    m = fresh()
    feed(m, FaultRanks({1: PE}, 0.0))
    controller_stops(m, {1: PE}, ("retry",))
    assert feed(m, Result(1, "repair failed", "retry", 2.0)) == [ChangeStrategy("dump")]
    assert m.phase is Phase.ENDED and m.strategy == "dump" and m.failed == "MindIO's retry failed: repair failed"


def test_a_second_chip_joins_the_stop_already_under_way() -> None:
    m = fresh()
    reset_gathered(m, 1)
    assert feed(m, Device(DeviceFaulty(0, "0x1", "reset"), 0.5), Tick(0.6, gathered=7)) == [LeaveGate(0)]
    assert controller_stops(m, {1: P}) == [ConfirmRanks({0: P, 1: P}), ChangeStrategy("recover")]


def test_the_shell_is_told_when_to_look() -> None:
    m = fresh()
    assert m.next_wake() is None and not m.polling and m.watched == ()
    feed(m, Device(DeviceFaulty(1, "0x1", "reset"), 0.0))
    assert m.polling and m.next_wake() == GATHER and m.watched == ()
    feed(m, Tick(0.1), Tick(0.2, gathered=3))
    assert m.polling and m.watched == (1,) and m.next_wake() == pytest.approx(0.2 + LEAVE)


# ---- seeded schedules ------------------------------------------------------------------------------

class Schedule:
    """A job on MindIO under random device events, with a MindIO controller that follows its protocol.

    Checks as it goes: phases move only along the table; the gate is held and released in turn; a
    rank is told to leave only when its chip is reset, killed only after ``leave_timeout``, started
    only once its old process is gone (or the start grace ran out) and never once the job failed;
    nothing is stopped or started once the job ended; after a tick no deadline is left behind (the
    shell would spin). At the end, with every chip recovered by then and every callback answered,
    the job is either healthy (no reset left, the gate released, IDLE) or failed with a reason.
    """

    def __init__(self, seed: int) -> None:
        self.pick = random.Random(seed)
        self.world = self.pick.randint(2, 4)
        self.m = MindX(leave_timeout=self.pick.choice((0.5, 2.0)), gather_timeout=self.pick.choice((1.0, 3.0)),
                       repair_timeout=self.pick.choice((5.0, 20.0, 60.0)))
        self.now = 0.0
        self.running = set(range(self.world))
        self.holding = False
        self.told_to_leave: dict[int, float] = {}
        self.recovered_at: dict[int, float] = {}
        self.reset_chips: set[int] = set()   # the plugin resets these once their process is gone
        self.queue: list = []                # MindIO's callbacks still to come, in order
        self.waiting_for: Optional[set[int]] = None  # ARF: the ranks MindIO waits to rejoin
        self.mindio_ended = False
        self.started: list[int] = []
        self.stuck: set[int] = set()         # ranks told to leave that never exit by themselves
        self.failure: Optional[str] = None   # the reason of the Fail decision, once there was one

    # -- the world ---------------------------------------------------------------------------------
    def send(self, event) -> None:
        before = self.m.phase
        decisions = self.m.handle(event)
        after = self.m.phase
        # One input moves the phase along the table, at most twice (a repair ends, a queued reset stops the job).
        once = {PHASE_TRANSITIONS.get((before, s)) for s in Step} - {None}
        twice = {PHASE_TRANSITIONS.get((p, s)) for p in once for s in Step} - {None}
        assert after is before or after in once | twice, (before, after)
        for decision in decisions:
            self.carry_out(decision)
        assert self.m.phase is not Phase.ENDED or self.m.failed is not None
        if isinstance(event, Tick):
            wake = self.m.next_wake()
            assert wake is None or wake > event.now, f"a deadline at {wake} left behind at {event.now}"

    def carry_out(self, d) -> None:
        m, now = self.m, self.now
        if isinstance(d, HoldGate):
            assert not self.holding, "held twice"
            self.holding = True
        elif isinstance(d, ReleaseGate):
            assert self.holding, "released without a hold"
            self.holding = False
        elif isinstance(d, LeaveGate):
            assert d.rank in self.reset_chips, f"rank {d.rank} told to leave without a reset"
            self.told_to_leave[d.rank] = now
            if self.pick.random() < 0.3:
                self.stuck.add(d.rank)
        elif isinstance(d, KillRank):
            assert d.rank in self.told_to_leave and now - self.told_to_leave[d.rank] >= m.leave_timeout - 1e-9
            self.running.discard(d.rank)
        elif isinstance(d, StartRank):
            assert self.failure is None, f"rank {d.rank} started after the job failed ({self.failure})"
            assert d.rank not in self.running or now >= self.recovered_at[d.rank] + m.leave_timeout + START_GRACE - 1e-9
            self.started.append(d.rank)
            self.running.add(d.rank)
            self.told_to_leave.pop(d.rank, None)
            self.stuck.discard(d.rank)
            self.reset_chips.discard(d.rank)
            if self.waiting_for is not None:
                self.waiting_for.discard(d.rank)
                if not self.waiting_for:
                    self.waiting_for = None
                    self.queue.append(Result(self.pick.choice((0,) * 9 + (1,)), "recover done", "recover", now))
        elif isinstance(d, StopTrain):
            assert m.phase is not Phase.ENDED
            errors = dict(d.ranks)
            offered = ("exit", "dump", "retry") if all(t == PE for t in errors.values()) else ARF
            stopped = self.pick.choice((0,) * 19 + (2,))  # MindIO rarely fails to stop the ranks
            self.queue += [FaultRanks(errors, now), StopComplete(stopped, "stop", errors, now),
                           Strategies(errors, offered, now)]
        elif isinstance(d, ChangeStrategy):
            if self.mindio_ended:
                return
            if d.strategy in ("dump", "exit"):
                self.mindio_ended = True
                self.queue.append(Result(0, "dumped", d.strategy, now))
            elif d.strategy == "retry":
                self.queue.append(Result(self.pick.choice((0,) * 9 + (1,)), "retried", "retry", now))
            else:
                self.waiting_for = set(m.off_device)
        elif isinstance(d, RejoinGate):
            assert d.rank in self.told_to_leave, f"rank {d.rank} rejoins the gate it was not sent away from"
        elif isinstance(d, Fail):
            assert self.failure is None, f"failed twice: {self.failure}, then {d.reason}"
            self.failure = d.reason
        elif isinstance(d, (ConfirmRanks, ElegantDump)):
            pass
        else:
            raise AssertionError(f"unknown decision {d!r}")

    def deliver(self) -> None:
        event = self.queue.pop(0)
        if isinstance(event, StopComplete) and event.code != 0:
            self.queue.clear()  # MindIO gives up on the episode
            self.mindio_ended = True
        if isinstance(event, Strategies) and self.m.phase is Phase.ENDED:
            return  # MindIO asks no strategy of a job that ended under it
        self.send(type(event)(**{**event.__dict__, "now": self.now}))

    def tick(self) -> None:
        gathered = 7 if self.holding and self.pick.random() < 0.7 else None
        self.send(Tick(self.now, joined=self.pick.random() < 0.9, gathered=gathered,
                       running=frozenset(self.running & set(self.m.watched))))

    def plugin(self) -> None:
        """The device plugin resets a chip once its process is gone, and says so."""
        for rank in sorted(self.reset_chips):
            if rank not in self.running and rank not in self.recovered_at and self.pick.random() < 0.8:
                self.recovered_at[rank] = self.now
                self.send(Device(DeviceRecovered(rank), self.now))

    def fault(self) -> None:
        """One fault: mostly a chip's reset, sometimes one MindIO sees itself, rarely one that ends the job."""
        what, rank = self.pick.random(), self.pick.randrange(self.world)
        if what < 0.55:
            self.reset_chips.add(rank)
            if rank not in self.m.resets:  # a new reset (else the event changes nothing)
                self.recovered_at.pop(rank, None)
            self.send(Device(DeviceFaulty(rank, "0x80E01801", "reset"), self.now))
        elif what < 0.63:
            self.reset_chips.add(rank)
            self.send(Device(DeviceFailed(rank, "isolate"), self.now))
        elif what < 0.83:
            self.send(FaultRanks({rank: PE if self.pick.random() < 0.8 else P}, self.now))
        elif what < 0.87:
            self.send(Device(StopJob("Volcano asked every training process to exit (GracefulExit)"), self.now))
        else:
            self.recovered_at.setdefault(rank, self.now)
            self.send(Device(DeviceRecovered(rank), self.now))  # out of the blue

    def step(self) -> None:
        self.now += self.pick.choice((0.01, 0.05, 0.3, 1.0))
        what = self.pick.random()
        if what < 0.4 and self.queue:
            self.deliver()
        elif what < 0.5:
            for rank in list(self.told_to_leave):
                if rank not in self.stuck and self.pick.random() < 0.5:  # it exits, unless it is stuck
                    self.running.discard(rank)
        elif what < 0.6:
            self.plugin()
        else:
            self.tick()

    def run(self, steps: int) -> None:
        faults_at = {self.pick.randrange(steps) for _ in range(self.pick.choice((0, 1, 1, 2, 3)))}
        for index in range(steps):
            if index in faults_at:
                self.fault()
            self.step()
        # No more faults: every chip comes back, every callback is answered, every deadline passes.
        self.now += 1000.0
        for _ in range(50):
            while self.queue:
                self.deliver()
            self.tick()
            self.plugin()
            self.now += 1.0

    def check_end(self) -> None:
        m = self.m
        if m.failed is None:
            assert m.off_device == () and m.phase is Phase.IDLE and not m.holding, (m.phase, m.resets)
        for rank in self.told_to_leave:
            assert rank not in self.running, f"rank {rank} still on its chip"


@pytest.fixture
def quiet_logs():
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_seeded_schedules_keep_the_invariants(quiet_logs) -> None:
    ends = {"healthy": 0, "failed": 0, "restarts": 0}
    for seed in range(600):
        schedule = Schedule(seed)
        try:
            schedule.run(300)
            schedule.check_end()
        except AssertionError as error:
            raise AssertionError(f"seed {seed}: {error}") from error
        ends["failed" if schedule.m.failed else "healthy"] += 1
        ends["restarts"] += len(schedule.started)
    # The schedules reach both ends, and ranks do come back.
    assert ends["healthy"] > 100 and ends["failed"] > 100 and ends["restarts"] > 100, ends


def test_the_schedules_catch_a_reset_that_never_goes_ahead(quiet_logs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MindX, "_advance", lambda self, now: [])
    with pytest.raises(AssertionError):
        for seed in range(200):
            schedule = Schedule(seed)
            schedule.run(300)
            schedule.check_end()


def test_the_schedules_catch_a_rank_left_on_its_chip(quiet_logs, monkeypatch: pytest.MonkeyPatch) -> None:
    real = MindX._observe

    def no_kill(self, tick):
        return [d for d in real(self, tick) if not isinstance(d, KillRank)]
    monkeypatch.setattr(MindX, "_observe", no_kill)
    with pytest.raises(AssertionError, match="still on its chip"):
        for seed in range(300):
            schedule = Schedule(seed)
            schedule.run(300)
            schedule.check_end()
