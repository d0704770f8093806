"""MindxStandIn, the shell of node 0's MindX: callbacks, reset-file events and ticks in, orders out.

Its rules are table-tested in tests/unit/flow/test_mindx.py; here a fake controller API and a fake gate
show the shell feeding them from its threads and carrying out what they decide. The real wheel
drives the same callbacks end to end in tests/integration/mindio/test_mindio_backend.py.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional

import pytest

from mindft.flow.mindx import MINDX_PROCESS_ERROR, MINDX_UCE_ERROR, Phase
from mindft.flow.states import IllegalTransition
from mindft.mindio import MindxStandIn
from mindft.flow.inputs import DeviceFaulty, DeviceRecovered, RollbackAll, StopJob


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
        self.looks = 0

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False

    def gathered(self) -> Optional[int]:
        self.looks += 1
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
    assert h.standin.phase is Phase.REPAIRING
    h.standin.on_device_event(DeviceRecovered(1))
    time.sleep(0.1)
    assert not any(order[0] == "start" for order in h.orders)  # its old process still runs
    h.alive[1] = False
    h.until(lambda: ("start", 1) in h.orders, "rank 1 started again")
    assert h.gate.rejoined == [1] and not h.gate.held and ("kill", 1) not in h.orders
    h.cb["report_result"](0, "Mindio do repair operation ok", {}, "recover")
    assert h.standin.phase is Phase.IDLE and h.standin.failed is None


def test_a_rank_that_does_not_leave_its_chip_is_killed() -> None:
    h = Harness(leave_timeout=0.2)
    h.standin.on_device_event(DeviceFaulty(1, "0x80E01801", "reset"))
    h.until(lambda: ("kill", 1) in h.orders, "the kill order")


def test_mindios_own_reports_are_answered_from_its_thread_at_once() -> None:
    h = Harness()
    h.cb["report_fault_ranks"]({1: MINDX_UCE_ERROR}, {})
    assert h.api.calls == [("stop_train", {1: MINDX_UCE_ERROR})]
    h.play_controller(("exit", "dump", "retry", "recover"))
    assert h.api.calls[1:] == [("on_global_rank", {1: MINDX_UCE_ERROR}), ("change_strategy", "retry")]
    h.cb["report_result"](0, "Mindio do repair operation ok", {}, "retry")
    assert h.standin.phase is Phase.IDLE and h.standin.failed is None


def test_a_graceful_exit_holds_the_gate_and_has_mindio_dump() -> None:
    h = Harness()
    h.standin.on_device_event(StopJob.graceful_exit((0, 1)))
    assert h.gate.held and h.api.calls == [("dump",)]
    assert "GracefulExit" in h.standin.failed


def test_events_mindio_cannot_act_on_are_logged_not_acted_on(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    h.standin.on_device_event(RollbackAll.process_fault(1, True))
    assert not h.api.calls and "RollbackAll is not acted on" in caplog.text


def test_callbacks_out_of_order_raise_in_mindios_thread() -> None:
    h = Harness()
    with pytest.raises(IllegalTransition):
        h.cb["report_stop_complete"](0, "stop ok", {1: MINDX_PROCESS_ERROR})  # no stop was asked for
    assert h.standin.phase is Phase.IDLE and not h.api.calls


def test_an_idle_stand_in_does_not_poll_and_closes_at_once() -> None:
    h = Harness()
    time.sleep(0.2)
    assert h.gate.looks == 0
    started = time.monotonic()
    h.standin.close()
    assert time.monotonic() - started < 1.0 and not h.standin._thread.is_alive()
    h.standin.on_device_event(DeviceFaulty(1, "0x80E01801", "reset"))  # after close: nothing happens
    time.sleep(0.1)
    assert h.gate.looks == 0 and not h.api.calls
