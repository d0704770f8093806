"""The snapshot schedule and the budget's choice of cadence (pure)."""
from __future__ import annotations

import pytest

from mindft.flow.cadence import Budget, Schedule, ScheduleError, choose_every, smoothed, worth_changing
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
