"""The rank side: what each action asks, and the window that keeps a common step."""
from __future__ import annotations

import pytest

from mindft.flow import Armed, Finished, Follower, Resumed
from mindft.flow.follower import CostMeter, StepEnd, joins_recovery
from mindft.protocol import Ack, Action, ActionKind, FaultKind


class Hooks:
    def __init__(self) -> None:
        self.calls: list = []
        self.held = [3, 4]

    def settle(self):
        self.calls.append("settle")
        return self.held

    def restore(self, step):
        self.calls.append(("restore", step))
        return [s for s in self.held if s <= step]

    def resume(self, step):
        self.calls.append(("resume", step))

    def arm(self, fault, detail):
        self.calls.append(("arm", fault))

    def dump_and_exit(self, step, reason):
        self.calls.append(("dump", step))
        raise SystemExit(3)


@pytest.mark.parametrize("every, slowest, step, allowed", [
    (1, 3, 4, True), (1, 2, 4, False), (3, 3, 6, True), (3, 2, 6, False), (2, 0, 2, True)])
def test_the_window(every: int, slowest: int, step: int, allowed: bool) -> None:
    follower = Follower(0, every)
    follower.on_progress(slowest)
    assert follower.may_capture(step) is allowed


@pytest.mark.parametrize("every, slowest, step, lockstep, answer", [
    (1, 3, 4, False, StepEnd(4, capture=True)),                         # the window is open: capture now
    (1, 2, 4, False, StepEnd(4, capture=True, await_window=True)),      # wait for the slowest rank first
    (3, 0, 4, False, StepEnd(4)),                                       # no capture step: report only
    (3, 0, 4, True, StepEnd(4, hold=True)),                             # lockstep: hold after the report
    (3, 2, 6, True, StepEnd(6, capture=True, await_window=True, hold=True)),
])
def test_the_end_of_a_step_is_one_answer(every: int, slowest: int, step: int, lockstep: bool,
                                         answer: StepEnd) -> None:
    follower = Follower(0, every)
    follower.on_progress(slowest)
    assert follower.end_of_step(step, lockstep) == answer
    assert follower.deciding == step  # decided: a new cadence must spare it


def test_a_full_round() -> None:
    follower, hooks = Follower(1), Hooks()
    follower.finished(4)
    assert follower.obey(Action(ActionKind.PAUSE, 4, round=1), hooks) == (Ack(1, ActionKind.PAUSE, 4, (3, 4), 1), None)
    ack, outcome = follower.obey(Action(ActionKind.ROLLBACK, 3, round=1), hooks)
    assert ack == Ack(1, ActionKind.ROLLBACK, 3, (3,), 1) and outcome is None
    ack, outcome = follower.obey(Action(ActionKind.RESUME, 3, round=1), hooks)
    assert outcome == Resumed(3) and follower.position == 3 and follower.slowest == 3
    assert hooks.calls == ["settle", ("restore", 3), ("resume", 3)]


def test_a_resume_without_the_rollback_restores_first() -> None:
    follower, hooks = Follower(0), Hooks()
    follower.finished(6)
    follower.obey(Action(ActionKind.RESUME, 4, round=2), hooks)
    assert hooks.calls == [("restore", 4), ("resume", 4)]


def test_actions_of_an_old_round_are_ignored() -> None:
    follower, hooks = Follower(0), Hooks()
    follower.obey(Action(ActionKind.PAUSE, 0, round=2), hooks)
    assert follower.obey(Action(ActionKind.ROLLBACK, 0, round=1), hooks) == (None, None)
    assert hooks.calls == ["settle"]


def test_inject_finish_and_dump() -> None:
    follower, hooks = Follower(0), Hooks()
    assert follower.obey(Action(ActionKind.INJECT_FAULT, 0, fault=FaultKind.UCE), hooks) == (None, Armed())
    assert follower.obey(Action(ActionKind.FINISH, 9), hooks) == (None, Finished())
    with pytest.raises(SystemExit):
        follower.obey(Action(ActionKind.DUMP_AND_EXIT, 4, reason="x"), hooks)
    assert hooks.calls == [("arm", FaultKind.UCE), ("dump", 4)]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="snapshot_every >= 1"):
        Follower(0, snapshot_every=0)


@pytest.mark.parametrize("steps, limits, reports", [
    ([1, 2, 3], [None, None, None], [1, 2, 3]),        # no replica to wait for: every step at once
    ([1, 2, 3], [0, 0, 0], [0, None, None]),            # the replica of step 1 has not arrived
    ([1, 2, 3], [0, 2, 5], [0, 2, 3]),                  # it arrived during step 3: limits rise
    ([4, 4], [None, None], [4, None]),                  # the same step twice: nothing new to say
])
def test_a_step_report_waits_for_its_replica(steps: list[int], limits: list, reports: list) -> None:
    follower = Follower(0)
    sent = [follower.report(step, limit) for step, limit in zip(steps, limits)]
    assert [None if r is None else r.step for r in sent] == reports


@pytest.mark.parametrize("recovering, position, reported, limit, released", [
    (False, 5, 3, 5, 5),       # the replica arrived: the held report goes
    (False, 5, 3, 4, 4),       # part of the way
    (False, 5, 3, 3, None),    # no further than what was sent
    (True, 5, 3, 5, None),     # a recovery decides where the ranks are: no report until RESUME
])
def test_a_held_report_is_released_when_the_limit_rises(recovering: bool, position: int, reported: int,
                                                        limit: int, released) -> None:
    follower = Follower(2)
    follower.report(position, reported)
    follower.recovering = recovering
    report = follower.release(limit)
    assert (None if report is None else report.step) == released
    if report is not None:
        assert report.rank == 2 and report.round == follower.round


def test_an_action_resets_what_was_reported() -> None:
    follower, hooks = Follower(0), Hooks()
    follower.report(4)
    for action in (Action(ActionKind.PAUSE, 4, round=1), Action(ActionKind.ROLLBACK, 3, round=1),
                   Action(ActionKind.RESUME, 3, round=1)):
        follower.forget_reports()
        follower.obey(action, hooks)
    assert follower.report(4).step == 4 and follower.report(4) is None
    follower.forget_reports()  # an INJECT_FAULT (or any action) in the same round: the same step again
    assert follower.report(4).step == 4


@pytest.mark.parametrize("faults, verdicts", [
    ([5, 5, 5], [True, True, True]),
    ([5, 5, 5, 5], [True, True, True, False]),     # the same step a fourth time in a row: give up
    ([5, 5, 6, 6, 5, 5], [True] * 6),               # another step in between starts the count again
    ([5, 5, 5, 5, 5], [True, True, True, False, False]),
])
def test_a_step_that_keeps_failing_is_given_up(faults: list[int], verdicts: list[bool]) -> None:
    follower = Follower(0)
    assert [follower.on_fault(step) for step in faults] == verdicts


@pytest.mark.parametrize("sent, now, figures, due", [
    (None, 0.0, (1.0, 0.1), True),            # the first figures: always
    ((1.0, 0.1), 0.5, (2.0, 0.5), False),     # within the minimum interval: never
    ((1.0, 0.1), 1.5, (1.0, 0.1), False),     # nothing moved
    ((1.0, 0.1), 1.5, (1.3, 0.1), True),      # the step moved by more than 20 %
    ((1.0, 0.1), 1.5, (1.0, 0.13), True),     # the snapshot moved by more than 20 %
    # Step 10 % shorter, snapshot 10 % longer: neither moved by 20 %, but a snapshot now costs
    # 22 % more steps' time, so the cadence may be over the budget: reported.
    ((1.0, 0.1), 1.5, (0.9, 0.11), True),
    # The share falling a little (the budget would allow a few more snapshots) is not worth a report.
    ((0.9, 0.11), 1.5, (0.95, 0.105), False),
])
def test_when_costs_are_worth_reporting(sent, now: float, figures: tuple, due: bool) -> None:
    meter = CostMeter()
    if sent is not None:
        meter.steps.value, meter.captures.value = sent
        assert meter.due(0.0) == sent
    meter.steps.value, meter.captures.value = figures
    assert (meter.due(now) == figures) is due


def test_costs_are_smoothed_and_not_reported_before_a_warm_sample_of_both() -> None:
    meter = CostMeter()
    meter.step(9.0)  # the first sample of each is cold: left out
    meter.capture(5.0)
    meter.step(1.0)
    assert meter.due(0.0) is None  # no warm snapshot yet
    meter.capture(-1.0)  # a clock step backwards counts as free, not negative
    meter.step(2.0)
    assert meter.due(0.0) == (pytest.approx(1.3), 0.0)


def test_a_cold_first_snapshot_is_not_what_the_rank_reports() -> None:
    # The rank: its first snapshot 0.0517 s, the next ones 0.0055 s, steps 0.068 s.
    meter = CostMeter()
    for seconds in (0.0517, 0.0055, 0.0055):
        meter.step(0.068)
        meter.capture(seconds)
    assert meter.due(0.0) == (pytest.approx(0.068), pytest.approx(0.0055))


@pytest.mark.parametrize("restarted, adopted, state, follows", [
    (False, False, "STARTING", False),    # a first incarnation trains from its start
    (False, True, "PAUSING", False),
    (True, True, "NORMAL", True),         # restarted with its state: the job rolls it back in
    (True, False, "NORMAL", False),       # restarted holding nothing while the job runs: start over
    (True, False, "starting", False),
    (True, False, "ROLLBACK", True),      # the job is recovering: wait for its ROLLBACK
    (True, False, "REPAIRING", True),
])
def test_a_restarted_rank_joins_the_recovery(restarted: bool, adopted: bool, state: str, follows: bool) -> None:
    assert joins_recovery(restarted, adopted, state) is follows


@pytest.mark.parametrize("every, slowest, expected", [(1, 7, 7), (3, 7, 6), (3, 5, 3), (2, 0, 0)])
def test_an_orphaned_rank_dumps_the_capture_every_rank_holds_as_last_heard(every, slowest, expected) -> None:
    follower = Follower(0, every)
    follower.on_progress(slowest)
    assert follower.orphan_step() == expected
