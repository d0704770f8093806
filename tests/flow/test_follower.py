"""The rank side: what each action asks, and the window that keeps a common step."""
from __future__ import annotations

import pytest

from mindft.flow import Armed, Finished, Follower, Resumed
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
