"""The rank's coordinators without sockets: mindft's RankLoop carrying out the follower's one answer
at a step's end, and MindIO's MindioLoop over a made-up processor and engine."""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Optional

import pytest

from mindft.config import MindftConfig
from mindft.flow.follower import Follower
from mindft.mindio.loop import GivenUpToMindio, MindioLoop
from mindft.mindio.rank import RecoveryRequested
from mindft.protocol import Action, ActionKind, FaultKind
from mindft.rank.loop import RankLoop, StepKeepsFailing


class Processor:
    """The processor's end-of-step calls, recorded; orders come from ``actions``."""

    def __init__(self, every: int = 1, slowest: int = 0) -> None:
        self.rank = 0
        self.follower = Follower(0, every)
        self.follower.on_progress(slowest)
        self.report_lock = threading.Lock()
        self.actions: deque[Action] = deque()
        self.calls: list = []
        self.sent: list = []

    def wait_window(self, step: int) -> Optional[Action]:
        self.calls.append(("wait_window", step))
        if self.actions:
            return self.actions.popleft()
        self.follower.on_progress(step - 1)  # the slowest rank's progress opens it
        return None

    def finished(self, step: int) -> None:
        self.calls.append(("finished", step))
        self.follower.report(step)

    def wait_peers(self, step: int) -> Optional[Action]:
        self.calls.append(("wait_peers", step))
        return self.actions.popleft() if self.actions else None

    def poll_action(self) -> Optional[Action]:
        self.calls.append("poll_action")
        return self.actions.popleft() if self.actions else None

    def wait_action(self) -> Action:
        return self.actions.popleft()

    def send(self, message: Any) -> None:
        self.sent.append(message)


class Hooks:
    def __init__(self) -> None:
        self.calls: list = []

    def settle(self):
        self.calls.append("settle")
        return [1]

    def restore(self, step):
        self.calls.append(("restore", step))
        return [step]

    def resume(self, step):
        self.calls.append(("resume", step))


@pytest.mark.parametrize("every, slowest, step, lockstep, calls", [
    (1, 3, 4, False, ["capture", ("finished", 4), "poll_action"]),
    (1, 2, 4, False, [("wait_window", 4), "capture", ("finished", 4), "poll_action"]),
    (3, 0, 4, False, [("finished", 4), "poll_action"]),
    (3, 0, 4, True, [("finished", 4), ("wait_peers", 4)]),
])
def test_a_step_end_carries_out_the_followers_one_answer(every: int, slowest: int, step: int, lockstep: bool,
                                                         calls: list) -> None:
    processor = Processor(every, slowest)
    loop = RankLoop(processor, Hooks())
    loop.lockstep = lockstep
    assert loop.end_step(step, lambda s: processor.calls.append("capture")) is None
    assert processor.calls == calls


def test_an_order_at_a_closed_window_is_obeyed_before_the_capture() -> None:
    processor, hooks = Processor(1, 2), Hooks()
    processor.follower.finished(3)
    processor.actions.extend([Action(ActionKind.PAUSE, 3, round=1), Action(ActionKind.ROLLBACK, 2, round=1),
                              Action(ActionKind.RESUME, 2, round=1)])
    loop = RankLoop(processor, hooks)
    assert loop.end_step(4, lambda s: processor.calls.append("capture")) == 2
    assert processor.calls == [("wait_window", 4)] and hooks.calls == ["settle", ("restore", 2), ("resume", 2)]


def test_a_step_that_keeps_failing_is_given_up() -> None:
    processor = Processor()
    loop = RankLoop(processor, Hooks())
    processor.follower.on_fault(5)
    processor.follower.on_fault(5)
    processor.follower.on_fault(5)
    with pytest.raises(StepKeepsFailing, match="step 5 failed 3 times in a row"):
        loop.fault(FaultKind.UCE, "again", 5)


class Mindio:
    """MindIO's processor as the training thread sees it: end_update may find the rank stopped."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.calls, self.stop = engine, [], False

    def end_update(self, step: int) -> None:
        self.calls.append(("end_update", step))
        if self.stop:
            raise RecoveryRequested("stopped")

    def recover(self) -> int:
        self.calls.append("recover")
        self.engine.loop._restore(3, None)  # MindIO's rollback handler
        return 3

    def report_fault(self, kind: FaultKind) -> int:
        self.calls.append(("report_fault", kind))
        return 3


class Engine:
    def __init__(self) -> None:
        self.config = MindftConfig(rank=0, world_size=2)
        self.step, self.meta, self.store, self.last_recovery = 0, {}, None, {}
        self.calls: list = []
        self.loop = MindioLoop(self)

    def put_back(self, step: int, exact: bool = True) -> int:
        self.calls.append(("put_back", step, exact))
        self.step = step - 1  # this rank never finished the repair step: it replays one
        return self.step


def test_mindio_ends_a_step_with_the_capture_then_the_update_and_follows_a_stop() -> None:
    engine = Engine()
    loop = engine.loop
    loop.mindio = mindio = Mindio(engine)
    assert loop.end_step(4, lambda s: mindio.calls.append(("capture", s))) is None
    mindio.stop = True
    assert loop.end_step(5, lambda s: mindio.calls.append(("capture", s))) == 2
    assert mindio.calls == [("capture", 4), ("end_update", 4), ("capture", 5), ("end_update", 5), "recover"]
    assert engine.calls == [("put_back", 3, False)] and "recovery_s" in engine.last_recovery
    assert loop.stops(RecoveryRequested("stopped")) and not loop.stops(RuntimeError("UCEError"))


def test_mindio_is_told_every_fault_as_uce_and_gives_up_the_scripts_own_errors() -> None:
    engine = Engine()
    loop = engine.loop
    loop.mindio = mindio = Mindio(engine)
    assert loop.fault(FaultKind.COMMUNICATION, "HCCEError", 4) is None
    assert mindio.calls == [("report_fault", FaultKind.UCE)] and engine.calls == [("put_back", 3, False)]
    with pytest.raises(GivenUpToMindio, match="not a device fault") as given_up:
        loop.fault(FaultKind.USER_ERROR, "ValueError", 4)
    assert given_up.value.ends_rank
    for _ in range(3):  # MAX_FAULTS_PER_STEP
        loop.fault(FaultKind.UCE, "again", 7)
    with pytest.raises(GivenUpToMindio, match="step 7 failed 3 times in a row"):
        loop.fault(FaultKind.UCE, "again", 7)
