"""Slow ranks (mindft.flow.slow): flagged after the windows in a row, cleared after as many healthy
ones, never on noise; the job's wiring (Pace in, SlowRank out, the status rows, a recovery's window)."""
from __future__ import annotations

import random

import pytest

from test_job import Driver

from mindft.config import load_config
from mindft.flow import SlowRank
from mindft.flow.slow import MIN_STEPS, PaceMeter, SlowChange, SlowPolicy, SlowRanks, policy_of
from mindft.protocol import FaultKind, FaultReport, Pace, StatusRequest

POLICY = SlowPolicy(threshold=0.3, windows=3, window=10.0)


def window(slow: SlowRanks, end: float, work: dict[int, float], steps: int = 20) -> list[SlowChange]:
    """One window of ``steps`` steps per rank, each rank's step taking ``work[rank]`` seconds of its own."""
    for rank, seconds in work.items():
        slow.pace(rank, steps, seconds)
    return slow.due(end)


def test_a_rank_50_percent_slower_is_flagged_after_three_windows_in_a_row_and_cleared_after_three_healthy() -> None:
    slow = SlowRanks(POLICY, 0.0)
    slowed = {0: 0.1, 1: 0.1, 2: 0.15, 3: 0.1}
    assert window(slow, 10.0, slowed) == [] and window(slow, 20.0, slowed) == []
    assert window(slow, 30.0, slowed) == [SlowChange(2, True, pytest.approx(1.5))]
    assert slow.flagged == {2} and slow.ratios[2] == pytest.approx(1.5)
    assert window(slow, 40.0, slowed) == []  # said once
    healthy = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1}
    assert window(slow, 50.0, healthy) == [] and window(slow, 60.0, healthy) == []
    assert window(slow, 70.0, healthy) == [SlowChange(2, False, pytest.approx(1.0))] and not slow.flagged


def test_a_healthy_window_between_slow_ones_starts_the_count_again() -> None:
    slow = SlowRanks(POLICY, 0.0)
    slowed, healthy = {0: 0.1, 1: 0.14}, {0: 0.1, 1: 0.1}
    for end, work in ((10.0, slowed), (20.0, slowed), (30.0, healthy), (40.0, slowed), (50.0, slowed)):
        assert window(slow, end, work) == []
    assert window(slow, 60.0, slowed) == [SlowChange(1, True, pytest.approx(1.4))]


def test_in_a_two_rank_job_only_the_slow_rank_is_flagged() -> None:
    slow = SlowRanks(SlowPolicy(windows=1, window=10.0), 0.0)
    assert window(slow, 10.0, {0: 0.2, 1: 0.1}) == [SlowChange(0, True, pytest.approx(2.0))]
    assert slow.ratios == {0: pytest.approx(2.0), 1: pytest.approx(0.5)}


def test_within_the_threshold_is_healthy_and_noise_flags_nothing() -> None:
    slow = SlowRanks(SlowPolicy(windows=1, window=10.0), 0.0)
    assert window(slow, 10.0, {0: 0.1, 1: 0.129, 2: 0.1}) == []
    # A busy machine: every rank's mean per window wobbles by up to ±12% (a window averages its steps).
    rng = random.Random(7)
    noisy = SlowRanks(POLICY, 0.0)
    for number in range(1, 2000):
        assert window(noisy, 10.0 * number, {rank: 0.1 * rng.uniform(0.88, 1.12) for rank in range(8)}) == []


def test_a_window_takes_the_median_of_a_ranks_reports() -> None:
    slow = SlowRanks(SlowPolicy(windows=1, window=10.0), 0.0)
    for seconds in (0.1, 0.1, 0.4):  # one report of a busy stretch
        slow.pace(0, 10, seconds)
        slow.pace(1, 10, 0.1)
    assert slow.due(10.0) == [] and slow.ratios == {0: 1.0, 1: 1.0}


def test_a_window_with_too_few_steps_or_one_rank_decides_nothing() -> None:
    slow = SlowRanks(SlowPolicy(windows=1, window=10.0), 0.0)
    assert window(slow, 10.0, {0: 0.1, 1: 0.5}, steps=MIN_STEPS - 1) == [] and slow.ratios == {}
    assert window(slow, 20.0, {1: 0.5}) == []
    assert slow.due(25.0) == []  # not the window's end yet
    assert window(slow, 30.0, {0: 0.1, 1: 0.5}) == [SlowChange(1, True, pytest.approx(5.0))]


def test_discard_starts_a_new_window() -> None:
    slow = SlowRanks(SlowPolicy(windows=1, window=10.0), 0.0)
    slow.pace(0, 20, 0.1)
    slow.pace(1, 20, 0.3)
    slow.discard(8.0)
    assert slow.due(10.0) == [] and slow.window_end == 18.0
    assert window(slow, 18.0, {0: 0.1, 1: 0.1}) == []


def test_the_pace_meter_reports_a_few_times_per_window_and_counts_from_zero_again() -> None:
    meter = PaceMeter(POLICY.report_every)
    assert POLICY.report_every == pytest.approx(10.0 / 3)
    assert meter.due(0.0) is None  # the first call starts the count
    for seconds in (0.1, 0.12, 0.5, 0.11, -1.0):  # a preempted step; a clock that went backwards: 0
        meter.work(seconds)
    assert meter.due(3.0) is None
    assert meter.due(3.4) == (5, pytest.approx(0.11))  # the median: one preempted step is no slow rank
    assert meter.due(10.0) is None  # nothing worked since


def test_the_policy_comes_from_the_environment_and_is_validated() -> None:
    policy = policy_of(load_config({"MINDFT_SLOW_THRESHOLD": "0.5", "MINDFT_SLOW_WINDOWS": "2",
                                    "MINDFT_SLOW_WINDOW": "5"}))
    assert policy == SlowPolicy(0.5, 2, 5.0)
    assert policy_of(load_config({})) == SlowPolicy(0.3, 3, 30.0)  # MindCluster's defaults
    with pytest.raises(ValueError, match="threshold > 0"):
        SlowPolicy(threshold=0)


def slow_effects(driver: Driver) -> list[SlowRank]:
    return [e for e in driver.effects if isinstance(e, SlowRank)]


def test_the_job_flags_a_slow_rank_from_its_paces_names_its_node_and_shows_it() -> None:
    d = Driver(3).start()
    d.job.nproc = 2  # two ranks per node, as the first node agent's hello says
    for number in range(1, 4):
        d.now = 30.0 * number - 0.5  # a Pace proves its rank alive, as any message
        for rank in range(3):
            d.send(rank, Pace(rank, 50, 0.2 if rank == 2 else 0.1))
        d.at(30.0 * number)
    (flagged,) = slow_effects(d)
    assert (flagged.rank, flagged.node, flagged.slow, flagged.ratio) == (2, 1, True, 2.0)
    assert "rank 2 (node 1) is slow: its own work per step is 2.00× its peers' median" in flagged.reason
    rows = d.send(0, StatusRequest())[0].message.ranks
    assert [(r.slow, r.work_ratio) for r in rows] == [(False, 0.667), (False, 0.667), (True, 2.0)]
    assert d.job.next_wakeup() <= 120.0  # the window's end wakes the controller


def test_a_recovery_discards_the_window_under_way_and_paces_sent_meanwhile() -> None:
    d = Driver(2).start()
    d.now = 5.0
    for rank in range(2):
        d.send(rank, Pace(rank, 50, 0.3 if rank else 0.1))
    d.send(1, FaultReport(1, 3, FaultKind.UCE, "UCE"))
    assert d.job.slow.window_end == 35.0  # a new window from the move on
    for rank in range(2):
        d.send(rank, Pace(rank, 50, 0.3 if rank else 0.1))  # while the job recovers: not training
    assert d.job.slow.due(35.0) == [] and d.job.slow.ratios == {}


@pytest.mark.parametrize("action, spare, moved", [("spare", True, True), ("spare", False, False),
                                                  ("report", True, False)])
def test_with_the_spare_action_a_slow_node_is_given_to_a_live_spare(action: str, spare: bool, moved: bool) -> None:
    from mindft.flow import Job, Send
    from mindft.flow.effects import GiveNode
    from mindft.protocol import AgentHello, Replaced
    from test_job import T

    policy = policy_of(load_config({"MINDFT_SLOW_ACTION": action, "MINDFT_SLOW_WINDOWS": "1"}))
    assert policy.to_spare is (action == "spare")
    d = Driver(3)
    d.job = Job(3, T, 0.0, slow=policy)
    d.start()
    peers = {0: b"", 1: b"agent/1", 2: b"agent/2"}
    for node, peer in peers.items():
        d.job.handle(peer, AgentHello(node, (node,)), 0.0)
    d.now = 29.5
    if spare:
        d.job.handle(b"agent/spare", AgentHello(-1, (), spare=True), d.now)
    for rank in range(3):
        d.send(rank, Pace(rank, 50, 0.2 if rank == 2 else 0.1))
    d.at(30.0)
    assert [e.rank for e in slow_effects(d)] == [2]
    given = [e for e in d.effects if isinstance(e, GiveNode)]
    told = [e for e in d.effects if isinstance(e, Send) and isinstance(e.message, Replaced)]
    assert [(g.node, g.spare) for g in given] == ([(2, b"agent/spare")] if moved else [])
    assert [(t.peer, t.message.node) for t in told] == ([(b"agent/2", 2)] if moved else [])
    if moved:
        assert "rank 2 (node 2) is slow" in given[0].reason and "given to a spare (adoption 1" in told[0].message.reason


def test_the_controllers_own_node_is_never_given_away_for_being_slow() -> None:
    from mindft.flow import Job
    from mindft.flow.effects import GiveNode
    from mindft.protocol import AgentHello
    from test_job import T

    d = Driver(2)
    d.job = Job(2, T, 0.0, slow=SlowPolicy(windows=1, to_spare=True))
    d.start()
    d.job.handle(b"", AgentHello(0, (0,)), 0.0)
    d.job.handle(b"agent/1", AgentHello(1, (1,)), 0.0)
    d.job.handle(b"agent/spare", AgentHello(-1, (), spare=True), 29.0)
    d.now = 29.5
    for rank in range(2):
        d.send(rank, Pace(rank, 50, 0.3 if rank == 0 else 0.1))
    d.at(30.0)
    assert [e.rank for e in slow_effects(d)] == [0] and not [e for e in d.effects if isinstance(e, GiveNode)]
