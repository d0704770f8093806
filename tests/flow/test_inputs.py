"""The one vocabulary of device inputs: the wire's device event decodes into it, equality ignores log-only fields."""
from __future__ import annotations

import pytest

from mindft.flow.inputs import DeviceFailed, DeviceFaulty, DeviceRecovered, HoldRepairs, RollbackAll, StopJob, from_wire
from mindft.protocol import DeviceEvent, DeviceStatus


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
