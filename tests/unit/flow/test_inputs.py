"""The one vocabulary of device inputs: the wire's device event decodes into it, equality ignores log-only fields."""
from __future__ import annotations

import pytest

from mindft.config import Timeouts
from mindft.flow.effects import Send
from mindft.flow.inputs import DeviceFailed, DeviceFaulty, DeviceRecovered, HoldRepairs, RollbackAll, StopJob, from_wire
from mindft.flow.job import Job
from mindft.flow.states import JobState
from mindft.protocol import DeviceEvent, DeviceStatus, Register, Reply


@pytest.mark.parametrize("message, expected", [
    (DeviceEvent(1, DeviceStatus.FAULTY, "0x80E01801", "reset"), DeviceFaulty(1, "0x80E01801", "reset")),
    (DeviceEvent(2, DeviceStatus.RECOVERED, "0x80E01801", "reset"), DeviceRecovered(2)),
    (DeviceEvent(3, DeviceStatus.FAILED, reason="isolated"), DeviceFailed(3, "isolated")),
])
def test_a_wire_device_event_is_the_same_input(message: DeviceEvent, expected: object) -> None:
    assert from_wire(message) == expected
    assert type(from_wire(message)) is type(expected)


@pytest.mark.parametrize("one, other, equal", [
    (DeviceFaulty(1, "0x1", "reset", "restart_request", 3, 1), DeviceFaulty(1, "0x1", "reset"), True),
    (DeviceFaulty(1, "0x1", "reset"), DeviceFaulty(1, "0x1", "restart"), False),
    (DeviceRecovered(1, "cleared"), DeviceRecovered(1), True),
    (HoldRepairs(True, 4), HoldRepairs(True), True),
    (StopJob.graceful_exit((1,), 7), StopJob.graceful_exit((1,)), True),
    (StopJob.graceful_exit((1,)), StopJob.graceful_exit(()), False),
    (RollbackAll.restart_all(2, "hotReset"), RollbackAll.restart_all(2), True),
    (RollbackAll.restart_all(2), RollbackAll.restart_all(3), False),
    (RollbackAll.process_fault(1, True), RollbackAll.process_fault(1, False), False),
])
def test_equality_ignores_only_what_describes_the_event(one: object, other: object, equal: bool) -> None:
    assert (one == other) is equal


def test_the_readers_meanings_are_the_flows_inputs() -> None:
    assert RollbackAll.process_fault(4, True, 2) == RollbackAll("clusterd reported a fault of rank 4", 4, True, 2)
    assert RollbackAll.restart_all(5).rank == -1
    assert StopJob.graceful_exit().reason == "Volcano asked every training process to exit (GracefulExit)"


def _job_with_two_ranks() -> Job:
    job = Job(2, Timeouts(), 0.0)
    for rank in (0, 1):
        job.handle(f"rank{rank}".encode(), Register(rank, 0, 100 + rank, (0,)), 0.0)
    assert job.state is JobState.NORMAL
    return job


@pytest.mark.parametrize("message, state, reply", [
    (DeviceEvent(1, DeviceStatus.FAULTY, "0x80E01801", "reset", request_id=7), JobState.PAUSING,
     Reply(True, "faulty event for rank 1", 7)),
    (DeviceEvent(1, DeviceStatus.FAILED, reason="isolated", request_id=8), JobState.FAILED,
     Reply(True, "failed event for rank 1", 8)),
    (DeviceEvent(5, DeviceStatus.FAULTY, request_id=9), JobState.NORMAL, Reply(False, "no rank 5", 9)),
])
def test_the_job_acts_on_a_wire_device_event_as_on_the_input(message: DeviceEvent, state: JobState,
                                                             reply: Reply) -> None:
    job = _job_with_two_ranks()
    out = job.handle(b"cli", message, 1.0)
    assert job.state is state
    assert Send(b"cli", reply) in out
