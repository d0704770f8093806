"""The snapshot schedule and the budget's choice of cadence (pure)."""
from __future__ import annotations

import logging
from typing import Callable

import pytest

from mindft.flow.cadence import (Budget, Schedule, ScheduleError, Tuner, WarmMean, choose_every, smoothed,
                                 worth_changing)
from mindft.flow.follower import CostMeter
from mindft.flow.job import held_after


def captures(schedule: Schedule, upto: int) -> list[int]:
    return [s for s in range(upto + 1) if schedule.is_capture(s)]


@pytest.mark.parametrize("every", [1, 2, 3, 7])
def test_a_fixed_schedule_is_the_old_cadence(every: int) -> None:
    schedule = Schedule.fixed(every)
    assert captures(schedule, 30) == list(range(0, 31, every))
    for progress in range(30):
        assert schedule.held_after(progress) == held_after(progress, every)
        assert schedule.before(progress + 1) == (progress - progress % every)


def test_a_new_segment_starts_at_a_capture_step_and_keeps_the_old_steps() -> None:
    old = Schedule.fixed(3)
    assert old.switch_point(4) == 12  # rank views <= 4: captures 6, waits at 9; 12 is undecided
    new = old.then(12, 2)
    assert captures(new, 20) == [0, 3, 6, 9, 12, 14, 16, 18, 20]
    assert new.before(14) == 12 and new.before(13) == 12 and new.before(12) == 9 and new.before(14, 2) == 9
    assert new.after(9) == 12 and new.after(12) == 14 and new.after(-1) == 0
    assert new.held_after(13) == {9, 12} and new.held_after(15) == {12, 14}
    assert new.agrees(old, 12) is None and new.agrees(old, 14) == 14
    assert Schedule.from_wire(new.wire()) == new
    assert new.pending(11) and not new.pending(12)


@pytest.mark.parametrize("segments", [(), ((1, 1),), ((0, 0),), ((0, 3), (4, 1)), ((0, 2), (4, 1), (4, 2))])
def test_malformed_schedules_are_refused(segments) -> None:
    with pytest.raises(ScheduleError):
        Schedule(segments)


def test_a_change_may_not_start_off_the_schedule_or_in_the_past() -> None:
    with pytest.raises(ScheduleError):
        Schedule.fixed(3).then(10, 2)
    with pytest.raises(ScheduleError):
        Schedule.fixed(3).then(12, 2).then(9, 1)


def test_the_budget_picks_the_cadence() -> None:
    budget = Budget(overhead=0.01, max_replay=100)
    # The 25 ms capture on a 140 ms step: 1% needs every 18th step.
    assert choose_every(0.140, 0.025, budget) == 18
    assert choose_every(0.430, 0.025, budget) == 6
    assert choose_every(0.001, 0.025, budget) == 100  # bounded by the replay limit
    assert choose_every(1.0, 0.005, budget) == 1
    assert choose_every(0.1, 0.02, Budget(overhead=0.1)) == 2
    # MindSpore's ATO: Young's interval sqrt(2 * 0.025 / (1e-3 * 0.140)) = 18.9 caps it.
    assert choose_every(0.140, 0.025, Budget(overhead=0.001, failure_rate=1e-3)) == 19


def test_small_wobbles_do_not_make_snapshots_more_frequent_but_the_budget_is_never_exceeded() -> None:
    # 18 -> 15: the budget would allow a few more snapshots; not worth an announcement.
    assert not worth_changing(18, 18) and not worth_changing(18, 15)
    assert worth_changing(18, 14) and worth_changing(1, 2)
    # 18 -> 19 or 20: every 18th step costs more than the budget now: change at once.
    assert worth_changing(18, 19) and worth_changing(18, 20) and worth_changing(18, 23)


def test_a_cadence_does_not_flip_back_to_one_that_sits_just_under_the_budget() -> None:
    # Every step went over the 1% budget: every 2. The next figures put a snapshot every step at
    # 0.95% of a step: within the budget, but the next wobble would undo it; at 0.5%, it fits with room.
    tuner = Tuner(1, BUDGET)
    tuner.report(0, 0.10, 0.0011)
    assert tuner.retune(0) is not None and tuner.every == 2
    tuner.report(0, 0.10, 0.00095)
    assert tuner.retune(10) is None and tuner.every == 2
    for _ in range(20):
        tuner.report(0, 0.10, 0.0005)
    assert tuner.retune(20) is not None and tuner.every == 1


def test_bad_budgets_are_refused() -> None:
    for bad in (dict(overhead=0), dict(overhead=2), dict(max_replay=0), dict(failure_rate=-1)):
        with pytest.raises(ValueError):
            Budget(**bad)


def test_a_smoothed_cost_starts_at_the_first_sample_and_follows_with_its_weight() -> None:
    assert smoothed(None, 2.0, 0.3) == 2.0
    assert smoothed(2.0, 3.0, 0.3) == pytest.approx(2.3)
    cost = None
    for sample in (1.0, 1.0, 10.0, 1.0):  # one slow step moves the figure by its weight only
        cost = smoothed(cost, sample, 0.5)
    assert cost == pytest.approx(3.25)


def test_a_warm_mean_leaves_out_the_first_sample_and_a_new_connections_first() -> None:
    mean = WarmMean(0.5)
    mean.add(0.050)  # the first push, with its connection's set-up
    assert mean.value is None
    mean.add(0.004)
    assert mean.value == 0.004  # the warm samples alone, not seeded from the cold one
    mean.add(0.002)
    assert mean.value == pytest.approx(0.003)
    mean.cold_again()  # reconnected: its first push pays the handshake again
    mean.add(0.050)
    assert mean.value == pytest.approx(0.003)  # the figure so far stays
    mean.add(0.003)
    assert mean.value == pytest.approx(0.003)


# The job (two hosts, node agents stream the replicas): a step takes 0.068 s, a rank's
# snapshot copy 0.0017 s, the node's replication 0.0038 s of CPU per snapshot once warm; its
# first push took 0.050 s with the connection's set-up: snapshot 0.0517 s, then 0.0055 s.
STEP, COPY, FIRST_PUSH, PUSH = 0.068, 0.0017, 0.050, 0.0038
BUDGET = Budget(overhead=0.01, max_replay=100)
PUSH_SMOOTHING, REPORT_INTERVAL = 0.5, 1.0  # the node's sender's (mindft.replica.sender; a shell, not imported here)


class Run:
    """One rank and its node agent's replication reporting to the job's Tuner on a fake clock,
    as the shells do: the rank's CostMeter (CostReport at most every second, when worth it), the
    node's push CPU as the sender keeps it (ReplicaReport at most every second, at once when its
    figure is first warm), the job retuning on each report and, while a change is pending, on the
    slowest rank's progress."""

    def __init__(self, push_cpu: Callable[[int], float]) -> None:
        self.tuner = Tuner(1, BUDGET)  # the job starts by snapshotting every step
        self.meter = CostMeter()
        self.pushes = WarmMean(PUSH_SMOOTHING)
        self.push_cpu = push_cpu  # the CPU of the node's n-th push
        self.now, self.step, self.captures = 0.0, 0, 0
        self.node_reported_at = -REPORT_INTERVAL
        self.capture()  # step 0

    def capture(self) -> None:
        self.meter.capture(COPY)
        warmed = self.pushes.value is None
        self.pushes.add(self.push_cpu(self.captures))
        self.captures += 1
        warmed = warmed and self.pushes.value is not None
        if warmed or self.now - self.node_reported_at >= REPORT_INTERVAL:
            self.node_reported_at = self.now
            if self.tuner.report_replication(1, self.pushes.value or 0.0):
                self.tuner.retune(self.step)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.now += STEP
            self.step += 1
            self.meter.step(STEP)
            if self.tuner.retune_due:
                self.tuner.retune(self.step)
            if self.tuner.schedule.is_capture(self.step):
                self.capture()
            figures = self.meter.due(self.now)
            if figures is not None:
                self.tuner.report(0, *figures)
                self.tuner.retune(self.step)

    def replayed(self, fault_step: int) -> int:
        """The steps a fault in ``fault_step`` replays: from the newest capture before it."""
        return fault_step - 1 - self.tuner.schedule.at_or_before(fault_step - 1)


def test_a_cold_first_sample_does_not_set_the_cadence(caplog) -> None:
    caplog.set_level(logging.INFO, "mindft.flow.cadence")
    run = Run(lambda push: FIRST_PUSH if push == 0 else PUSH)
    run.run(200)
    warm = choose_every(STEP, COPY + PUSH, BUDGET)
    assert warm == 9 and choose_every(STEP, COPY + FIRST_PUSH, BUDGET) == 77  # what the cold sample chose
    segments = run.tuner.schedule.segments
    assert max(every for _, every in segments) == warm  # never snapshots more rarely than warm figures say
    start, every = segments[-1]
    assert every == warm and run.tuner.schedule.is_capture(start)
    assert sum(run.tuner.schedule.is_capture(s) for s in range(start)) <= 6  # converged within a few snapshots
    assert run.replayed(55) <= warm  # the fault at step 55 replayed 51 steps
    changes = [r.getMessage() for r in caplog.records if "snapshot cadence" in r.getMessage()]
    assert len(changes) == len(segments) - 1
    assert f"-> every {warm} steps" in changes[-1] and "more than the 1% allowed" in changes[-1]
    assert "of which 0.0038 s the busiest node's replication CPU" in changes[-1]


def test_a_genuinely_slow_snapshot_still_raises_the_cadence(caplog) -> None:
    caplog.set_level(logging.INFO, "mindft.flow.cadence")
    slow = Run(lambda push: FIRST_PUSH)  # every push slow, not only the first
    slow.run(300)
    assert slow.tuner.every == 77
    # Warm at first, then the replication slows down for good (a busier link): N follows up.
    slower = Run(lambda push: PUSH if push < 40 else FIRST_PUSH)
    slower.run(2000)
    assert [every for _, every in slower.tuner.schedule.segments][-1] == 77
    assert "more than the 1% allowed" in caplog.records[-1].getMessage()


def test_a_cadence_that_snapshots_too_often_says_why_it_changes(caplog) -> None:
    caplog.set_level(logging.INFO, "mindft.flow.cadence")
    tuner = Tuner(20, BUDGET)
    tuner.report(0, 0.10, 0.010)  # 0.5% every 20 steps: every 10 fits the 1% budget, every 13 with room
    assert tuner.retune(0) is not None and tuner.every == 13
    assert "every 20 step(s) cost 0.5% of the step, every 13 fits the 1% allowed (0.8%)" in caplog.text
    ato = Tuner(20, Budget(overhead=0.01, max_replay=100, failure_rate=0.01))
    ato.report(0, 0.10, 0.010)  # Young's interval sqrt(2 * 0.01 / (0.01 * 0.1)) = 4.5
    assert ato.retune(0) is not None and ato.every == 4
    assert "Young's interval for 0.01 faults per step (ATO)" in caplog.text
