"""A rank's heartbeats and its verdict on a silent controller, with made-up times."""
from __future__ import annotations

import pytest

from mindft.flow.liveness import Check, Liveness, Verdict

INTERVAL, DEAD_AFTER = 1.0, 5.0


def liveness(retries: int = 3, first_contact: int = 3) -> Liveness:
    return Liveness(INTERVAL, DEAD_AFTER, retries, first_contact, now=0.0)


@pytest.mark.parametrize("sent, heard, reported, now, beat", [
    (0.0, 0.0, 0.0, 0.5, False),   # within the interval on both sides
    (0.0, 0.0, 0.0, 1.0, True),    # nothing sent for an interval
    (0.9, 0.9, 0.0, 1.5, False),   # sent and heard recently
    (0.0, 0.9, 0.9, 1.5, False),   # a step report (training thread's socket) counts as sent
    (0.9, 0.0, 0.0, 1.5, True),    # sent, but heard nothing for an interval: ask
    (0.0, 0.9, 0.0, 1.5, True),    # heard, but sent nothing for an interval
])
def test_a_heartbeat_is_due_only_after_an_interval_of_silence(sent: float, heard: float, reported: float,
                                                            now: float, beat: bool) -> None:
    live = liveness()
    live.received(heard)
    live.sent(sent)
    assert live.check(now, reported).beat is beat


def test_a_heartbeat_resets_its_own_clock() -> None:
    live = liveness()
    assert live.check(1.0, 0.0).beat
    assert not live.check(1.5, 0.0).beat
    assert live.check(2.0, 0.0).beat


@pytest.mark.parametrize("heard_once, retries, first_contact, silences, verdicts", [
    # Heard before: reconnect after each silent period, give up on the retries-th in a row.
    (True, 3, 3, 3, [Verdict.RECONNECT, Verdict.RECONNECT, Verdict.SILENT]),
    # Never heard, started by hand (one silent period): give up at once.
    (False, 3, 1, 1, [Verdict.NEVER_ANSWERED]),
    # Never heard, started by mindft-launch (the controller may come up late): the same patience.
    (False, 3, 3, 3, [Verdict.RECONNECT, Verdict.RECONNECT, Verdict.NEVER_ANSWERED]),
    (True, 1, 1, 1, [Verdict.SILENT]),
])
def test_silence(heard_once: bool, retries: int, first_contact: int, silences: int,
                 verdicts: list[Verdict]) -> None:
    live = liveness(retries, first_contact)
    now = 0.0
    if heard_once:
        live.received(now)
    seen = []
    for _ in range(silences):
        now += DEAD_AFTER + 0.01
        seen.append(live.check(now, 0.0).verdict)
    assert seen == verdicts


def test_a_frame_heard_ends_the_silent_streak() -> None:
    live = liveness(retries=2)
    live.received(0.0)
    assert live.check(5.5, 0.0) == Check(True, Verdict.RECONNECT, 5.5, 1)
    live.received(6.0)
    assert live.check(11.5, 0.0).verdict is Verdict.RECONNECT  # the streak started again
    assert live.check(17.0, 0.0).verdict is Verdict.SILENT


def test_alive_within_dead_after() -> None:
    live = liveness()
    live.received(0.0)
    assert live.check(DEAD_AFTER, 0.0).verdict is Verdict.ALIVE


@pytest.mark.parametrize("sent, heard, reported, now, timeout", [
    (0.0, 0.0, 0.0, 0.0, 1.0),   # the next heartbeat
    (0.0, 0.0, 0.6, 0.5, 0.5),   # heard nothing since 0: a heartbeat is due at 1.0 all the same
    (0.8, 0.8, 0.8, 1.0, 0.8),
    (0.0, 0.0, 0.0, 3.0, 0.0),   # overdue: check now
])
def test_the_poll_timeout(sent: float, heard: float, reported: float, now: float, timeout: float) -> None:
    live = liveness()
    live.received(heard)
    live.sent(sent)
    assert live.timeout(now, reported) == pytest.approx(timeout)


def test_registering_restarts_the_silence_clock() -> None:
    live = liveness()
    live.registering(4.0)
    assert live.check(8.0, 0.0).verdict is Verdict.ALIVE
