"""Goodput (mindft.flow.goodput): every second of the job's wall time in one bucket, the buckets
summing to the wall time; then through the Job, with a recovery and its replayed steps."""
from __future__ import annotations

import pytest

from mindft.flow import JobState
from mindft.flow.goodput import BADPUT, PRODUCTIVE, Goodput, ratio
from mindft.protocol import ActionKind, FaultKind, FaultReport, Register
from test_job import Driver

S = JobState


def test_each_state_counts_in_its_bucket_and_the_buckets_sum_to_the_wall_time() -> None:
    goodput = Goodput(started=100.0)
    goodput.moved(S.NORMAL, 0, 105.0)  # 5 s of start-up
    goodput.progress(4, 0.1, 106.0)  # training: snapshots cost 10% of a step from here on
    goodput.progress(10, 0.1, 116.0)
    goodput.moved(S.PAUSING, 10, 117.0)  # the slowest rank had reached step 10
    goodput.moved(S.REPAIRING, 10, 117.5)
    goodput.moved(S.ROLLBACK, 10, 120.5)
    goodput.moved(S.RESUMING, 6, 120.75)
    goodput.moved(S.NORMAL, 6, 121.0)  # back at step 6: steps 7..10 are replayed
    goodput.progress(8, 0.1, 123.0)
    goodput.progress(10, 0.1, 125.0)  # caught up
    goodput.progress(12, 0.1, 127.0)
    goodput.moved(S.DONE, 12, 127.0)
    seconds = goodput.at(200.0)  # the clock stopped with the job
    # Training: 1 s before any cost was known, then 13 s of which snapshots took 10%; 4 s replayed.
    assert seconds == pytest.approx({PRODUCTIVE: 1.0 + 0.9 * 13, "start-up": 5.0, "snapshots": 0.1 * 13,
                                     "pause": 0.5, "repair": 3.0, "rollback": 0.25, "resume": 0.25, "replayed": 4.0,
                                     "smaller world": 0.0})
    assert sum(seconds.values()) == pytest.approx(27.0) and list(seconds) == [PRODUCTIVE, *BADPUT]
    assert ratio(seconds) == pytest.approx(12.7 / 27.0)


def test_through_the_job_a_recovery_and_its_replay_are_badput_and_the_sum_is_the_wall_time() -> None:
    d = Driver(2).start()  # registered at 0: no start-up here
    d.now = 1.0
    d.steps(6)
    d.now = 7.0
    d.send(1, FaultReport(1, 7, FaultKind.UCE))
    d.now = 7.5
    d.ack_all(ActionKind.PAUSE, 7, held=(5, 6))
    d.now = 8.0
    d.ack_all(ActionKind.ROLLBACK, 6, held=(5, 6))
    d.ack_all(ActionKind.RESUME, 6, held=(5, 6))
    assert d.job.state is S.NORMAL
    status = d.job.status(12.0)
    buckets = dict(zip(status.badput, status.badput_seconds))
    assert status.wall_seconds == pytest.approx(12.0)
    assert status.productive_seconds + sum(buckets.values()) == pytest.approx(status.wall_seconds)
    assert buckets["pause"] == pytest.approx(0.5) and buckets["rollback"] + buckets["resume"] == pytest.approx(0.5)
    assert status.productive_seconds == pytest.approx(11.0)


def test_a_job_still_starting_is_all_start_up() -> None:
    d = Driver(2)
    d.send(0, Register(0, 0, 10))
    status = d.job.status(3.0)
    assert status.productive_seconds == 0 and dict(zip(status.badput, status.badput_seconds))["start-up"] == 3.0


def test_an_elastic_job_on_fewer_nodes_counts_the_capacity_it_lost_as_a_smaller_world() -> None:
    goodput = Goodput(started=0.0)
    goodput.moved(S.NORMAL, 0, 0.0)
    goodput.progress(1, 0.0, 10.0)  # 10 s on every node
    goodput.resized(2 / 3, 10.0)  # one node of three left behind
    goodput.progress(4, 0.0, 40.0)
    seconds = goodput.at(40.0)
    assert seconds[PRODUCTIVE] == pytest.approx(10.0 + 20.0) and seconds["smaller world"] == pytest.approx(10.0)
    assert sum(seconds.values()) == pytest.approx(40.0)
