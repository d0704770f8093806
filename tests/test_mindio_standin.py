"""MindxStandIn, node 0's MindX for MindIO's controller: its answers, with a fake controller API.

The real wheel drives the same callbacks end to end in tests/integration/test_mindio_backend.py.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional

import pytest

from mindft.mindio import MINDX_PROCESS_ERROR, MINDX_UCE_ERROR, MindxStandIn, StandInPhase
from mindft.flow.inputs import DeviceFailed, DeviceFaulty, DeviceRecovered, RollbackAll


class FakeApi:
    """The ``tft_notify_controller_*`` calls of ``mindio_ttp.controller_ttp``, recorded."""

    def __init__(self) -> None:
        self.calls: List[tuple] = []

    def tft_notify_controller_stop_train(self, ranks: dict) -> int:
        self.calls.append(("stop_train", dict(ranks)))
        return 0

    def tft_notify_controller_on_global_rank(self, ranks: dict, time: int = 1) -> int:
        self.calls.append(("on_global_rank", dict(ranks)))
        return 0

    def tft_notify_controller_change_strategy(self, strategy: str, params: str = "") -> int:
        self.calls.append(("change_strategy", strategy))
        return 0

    def tft_notify_controller_dump(self) -> int:
        self.calls.append(("dump",))
        return 0


class FakeGate:
    def __init__(self, step: Optional[int] = 7) -> None:
        self.step, self.joined, self.held, self.left, self.rejoined = step, True, False, [], []

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False

    def gathered(self) -> Optional[int]:
        return self.step if self.held else None

    def leave(self, ranks: Any) -> None:
        self.left.extend(ranks)

    def rejoin(self, rank: int) -> None:
        self.rejoined.append(rank)


class Harness:
    instances: List["Harness"] = []

    def __init__(self, **timeouts: float) -> None:
        self.api, self.gate = FakeApi(), FakeGate()
        self.alive = {0: True, 1: True}
        self.orders: List[tuple] = []
        self.standin = MindxStandIn(self.gate, kill=lambda r, why: self.orders.append(("kill", r)),
                                    start=lambda r, why: self.orders.append(("start", r)),
                                    alive=lambda r: self.alive[r], **timeouts)
        self.standin.bind(self.api)
        self.cb = self.standin.callbacks()
        Harness.instances.append(self)

    def until(self, condition, what: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.api.calls} {self.orders}"
            time.sleep(0.01)

    def play_controller(self, offered=("exit", "dump", "recover")) -> None:
        """What MindIO's controller thread does after a stop_train, as in controller.cpp."""
        errors = self.api.calls[-1][1]
        self.cb["report_fault_ranks"](errors, {})
        self.cb["report_stop_complete"](0, "stop ok", errors)
        self.cb["report_fault_ranks"](errors, {})  # MindIO's second report: ignored
        self.cb["report_strategies"](errors, list(offered))


@pytest.fixture(autouse=True)
def close_standins():
    yield
    while Harness.instances:
        Harness.instances.pop().standin.close()


def test_a_hot_reset_goes_through_mindio_arf_and_restarts_the_rank_once_its_process_is_gone() -> None:
    h = Harness(leave_timeout=5.0)
    h.standin.on_device_event(DeviceFaulty(1, "0x80E01801", "reset"))
    h.until(lambda: h.api.calls, "stop_train")
    assert h.gate.held and h.api.calls[0] == ("stop_train", {1: MINDX_PROCESS_ERROR})
    h.until(lambda: h.gate.left == [1], "rank 1 told to leave")
    h.play_controller()
    assert h.api.calls[1:] == [("on_global_rank", {1: MINDX_PROCESS_ERROR}), ("change_strategy", "recover")]
    assert h.standin.phase is StandInPhase.REPAIRING
    h.standin.on_device_event(DeviceRecovered(1))
    time.sleep(0.1)
    assert not any(order[0] == "start" for order in h.orders)  # its old process still runs
    h.alive[1] = False
    h.until(lambda: ("start", 1) in h.orders, "rank 1 started again")
    assert h.gate.rejoined == [1] and not h.gate.held and ("kill", 1) not in h.orders
    h.cb["report_result"](0, "Mindio do repair operation ok", {}, "recover")
    assert h.standin.phase is StandInPhase.IDLE and h.standin.failed is None


def test_a_rank_that_does_not_leave_its_chip_is_killed() -> None:
    h = Harness(leave_timeout=0.2)
    h.standin.on_device_event(DeviceFaulty(1, "0x80E01801", "reset"))
    h.until(lambda: ("kill", 1) in h.orders, "the kill order")


def test_a_failed_chip_turns_the_arf_wait_into_a_dump() -> None:
    h = Harness(leave_timeout=5.0)
    h.standin.on_device_event(DeviceFaulty(1, "0x80E01801", "reset"))
    h.until(lambda: h.api.calls, "stop_train")
    h.play_controller()
    h.alive[1] = False
    h.standin.on_device_event(DeviceFailed(1, "status failed, policy isolate"))
    assert h.api.calls[-1] == ("change_strategy", "dump")
    assert "rank 1's chip failed" in h.standin.failed
    h.cb["report_result"](0, "do dump success", {}, "dump")
    assert h.standin.phase is StandInPhase.ENDED
    h.standin.on_device_event(DeviceRecovered(1))  # too late: the job is over
    time.sleep(0.1)
    assert ("start", 1) not in h.orders


def test_a_chip_that_fails_before_the_stop_is_dumped_not_repaired() -> None:
    h = Harness(leave_timeout=5.0)
    h.standin.on_device_event(DeviceFailed(0, "status failed, policy isolate"))
    h.until(lambda: h.api.calls, "stop_train")
    h.play_controller()
    assert h.api.calls[-1] == ("change_strategy", "dump") and h.gate.left == [0]


def test_faults_mindio_reports_itself_are_retried_in_place_or_dumped() -> None:
    h = Harness()
    h.cb["report_fault_ranks"]({1: MINDX_UCE_ERROR}, {})
    assert h.api.calls == [("stop_train", {1: MINDX_UCE_ERROR})]
    h.play_controller(("exit", "dump", "retry", "recover"))
    assert h.api.calls[-1] == ("change_strategy", "retry")
    h.cb["report_result"](0, "Mindio do repair operation ok", {}, "retry")
    assert h.standin.phase is StandInPhase.IDLE
    # A process lost without a reset of its chip: mindft-launch does not restart it on MindIO.
    h.cb["report_fault_ranks"]({0: MINDX_PROCESS_ERROR}, {})
    h.play_controller()
    assert h.api.calls[-1] == ("change_strategy", "dump") and h.standin.failed
    assert h.standin.phase is StandInPhase.ENDED


def test_events_mindio_cannot_act_on_are_logged_not_acted_on(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.standin.on_device_event(RollbackAll.process_fault(1, True))
    assert not h.api.calls and "RollbackAll is not acted on" in caplog.text


def test_illegal_phase_moves_raise() -> None:
    h = Harness()
    from mindft.mindio import MindioError

    with pytest.raises(MindioError):
        with h.standin._lock:
            h.standin._move(StandInPhase.REPAIRING)
