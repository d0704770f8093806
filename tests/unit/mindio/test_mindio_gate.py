"""The step gate of the mindio backend (real ZeroMQ on 127.0.0.1, CurveZMQ) and the exit-grace quirk."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest

from mindft.exitcodes import ExitCode
from mindft.net.keys import generate_keys
from mindft.mindio import MindioError, MindioExit, RecoveryRequested, StepGate, StepGateClient


class Flags:
    """What StepGateClient.wait asks of a MindioRank: ``check()`` raises once MindIO asked for something."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.exit = threading.Event()

    def check(self) -> None:
        if self.exit.is_set():
            raise MindioExit(int(ExitCode.DUMPED), "test")
        if self.stop.is_set():
            raise RecoveryRequested("test")


@pytest.fixture
def gate(tmp_path: Path):
    keys = generate_keys(tmp_path / "keys.json")
    server = StepGate(2, "127.0.0.1", keys)
    clients = [StepGateClient(server.endpoint, rank, keys) for rank in range(2)]
    yield server, clients, keys
    for client in clients:
        client.close()
    server.close()


def wait_in_thread(client: StepGateClient, done: int, need: int, flags: Flags, finished: bool = False):
    outcome: List[object] = []

    def run() -> None:
        try:
            client.wait(done, need, flags, finished)
            outcome.append("open")
        except BaseException as error:  # the test inspects it
            outcome.append(error)

    thread = threading.Thread(target=run, name="gate-test", daemon=True)
    thread.start()
    return thread, outcome


def test_a_rank_waits_until_every_rank_finished_the_step_before(gate) -> None:
    _, (rank0, rank1), _ = gate
    flags = Flags()
    thread, outcome = wait_in_thread(rank0, 3, 3, flags)  # rank 0 did 3 steps, wants to start step 4
    thread.join(0.5)
    assert thread.is_alive() and not outcome  # rank 1 never reported
    rank1.wait(2, 2, flags)  # rank 1 did 2: its own request opens (everyone did 2), rank 0's does not
    thread.join(0.5)
    assert thread.is_alive()
    rank1.wait(3, 3, flags)
    thread.join(5)
    assert outcome == ["open"]


def test_a_stop_or_exit_from_mindio_leaves_the_gate(gate) -> None:
    _, (rank0, _), _ = gate
    flags = Flags()
    thread, outcome = wait_in_thread(rank0, 5, 5, flags)
    flags.stop.set()
    thread.join(5)
    assert isinstance(outcome[0], RecoveryRequested)
    flags.stop.clear()
    flags.exit.set()
    with pytest.raises(MindioExit):
        rank0.wait(5, 5, flags)


def test_finished_means_every_rank_finished_and_a_rollback_reopens_it(gate) -> None:
    _, (rank0, rank1), _ = gate
    flags = Flags()
    thread, outcome = wait_in_thread(rank0, 12, -1, flags, finished=True)
    rank1.wait(11, 11, flags)  # rank 1 rolled back / still training
    thread.join(0.5)
    assert thread.is_alive()
    rank1.wait(12, -1, flags, finished=True)
    thread.join(5)
    assert outcome == ["open"]


def test_the_last_wait_opens_only_after_the_action_once_every_rank_finished(tmp_path: Path) -> None:
    # mindft-launch destroys MindIO's controller there, before any rank destroys its processor.
    release, calls = threading.Event(), []
    server = StepGate(2, "127.0.0.1", when_all_finished=lambda: (calls.append(time.monotonic()), release.wait(10)))
    rank0, rank1 = (StepGateClient(server.endpoint, rank) for rank in range(2))
    try:
        flags = Flags()
        first, first_outcome = wait_in_thread(rank0, 7, -1, flags, finished=True)
        first.join(0.5)
        assert first.is_alive() and calls == []  # rank 1 still trains: nothing ends yet
        last, last_outcome = wait_in_thread(rank1, 7, -1, flags, finished=True)
        last.join(0.5)
        assert len(calls) == 1 and first.is_alive() and last.is_alive()  # both wait for the action
        release.set()
        first.join(5), last.join(5)
        assert first_outcome == last_outcome == ["open"] and len(calls) == 1
    finally:
        release.set()
        rank0.close(), rank1.close()
        server.close()


def test_the_gate_refuses_a_client_without_the_job_key(gate, tmp_path: Path, monkeypatch) -> None:
    from mindft.mindio import gate as gate_module

    server, _, _ = gate
    monkeypatch.setattr(gate_module, "GATE_UNREACHABLE_AFTER", 0.5)
    stranger = StepGateClient(server.endpoint, 0, generate_keys(tmp_path / "other.json"))
    try:
        with pytest.raises(MindioError, match="did not answer"):
            stranger.wait(0, 0, Flags())
    finally:
        stranger.close()


def test_a_rank_stuck_after_mindios_exit_order_is_ended_not_waited_on(tmp_path: Path) -> None:
    """MindIO's exit handler cannot interrupt a CPU collective: past the grace period the process ends."""
    code = """
import time
from mindft.mindio import MindioRank, RankCallbacks
rank = MindioRank(0, 1, "127.0.0.1", 29999, RankCallbacks(settle=lambda: None, restore=lambda s, r: None,
                  dump=lambda reason: None), exit_grace=0.5)
rank._exit_code = 3
rank._on_exit(None)   # what MindIO's processor thread calls
time.sleep(60)        # the training thread is stuck (a collective that cannot be aborted)
"""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], timeout=30, capture_output=True, text=True)
    assert result.returncode == ExitCode.DUMPED, result.stderr
    assert time.monotonic() - started < 20


def test_a_held_gate_gathers_the_ranks_at_the_newest_step_and_sends_the_chips_ranks_away(gate) -> None:
    from mindft.mindio import ResetRequested

    server, (rank0, rank1), _ = gate
    flags = Flags()
    first, first_outcome = wait_in_thread(rank0, 4, 3, flags)  # rank 0 finished 4, wants to start 5
    rank1.wait(3, 3, flags)  # rank 1 is one step behind
    first.join(5)
    assert first_outcome == ["open"]
    server.hold()
    assert server.gathered() is None  # nobody is waiting yet
    ahead, ahead_outcome = wait_in_thread(rank0, 5, 5, flags)  # rank 0 finished 5: held there
    rank1.wait(4, 4, flags)  # the rank behind catches up to 5 (it may start step 5)...
    behind, behind_outcome = wait_in_thread(rank1, 5, 5, flags)  # ...and is held after it
    deadline = time.monotonic() + 5
    while server.gathered() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.gathered() == 5
    assert ahead.is_alive() and behind.is_alive()
    server.leave([1])
    behind.join(5)
    assert isinstance(behind_outcome[0], ResetRequested)
    assert ahead.is_alive()  # the healthy rank stays held
    server.rejoin(1)
    server.release()
    rank1.wait(5, 5, flags)  # the restarted rank, at the gathered step: everyone did 5
    ahead.join(5)
    assert ahead_outcome == ["open"]
