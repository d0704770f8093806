"""The pause → repair → rollback → resume flow between real processes on 127.0.0.1.

The controller runs on a thread of the test process; every rank is a subprocess running
tests/fake_rank.py (the rank engine and a fake training loop whose final
state is only right if every rollback restored the right step). The rules themselves (phase
timeouts, device resets and failures, stale exits) are proven in tests/unit/flow/; this keeps
what needs processes and sockets: kills, SIGSTOP, garbage on the wire, real timers, the CLI.
The controller with Processors of the test process alone: tests/unit/controller/.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import zmq

from mindft.net import channel
from mindft.config import MindftConfig, Timeouts
from mindft.exitcodes import ExitCode
from mindft.flow import JobState
from mindft.net.keys import generate_keys, secure_client
from mindft.rank.processor import Processor, ProcessorError
from mindft.protocol import FaultKind, InjectRequest, OrderKind, ProcessExit, RankOrder, StatusRequest, encode

from harness import FAKE_RANK, ControllerJob, environment, free_port, job_fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RANK_SCRIPT = FAKE_RANK
EXIT_DUMPED = ExitCode.DUMPED
EXIT_OK, EXIT_FAILED = ExitCode.OK, ExitCode.FAILED
ControllerState = JobState


def request(config: MindftConfig, message, timeout: float = 5.0):
    return channel.request(config.controller_address, None, message, timeout)
# Short but not twitchy on 2 busy cores: a rank is declared dead after 2 s of silence.
FAST = Timeouts(heartbeat_interval=0.05, heartbeat_misses=40, register=30.0, pause=10.0,
                repair=15.0, rollback=10.0, resume=10.0, connect_retries=5)


def expected_state(steps: int) -> int:
    return steps * (steps + 1) // 2


class Job(ControllerJob):
    """A controller thread plus fake_rank.py subprocesses; a rank that left its device starts again."""

    def __init__(self, tmp: Path, world_size: int, timeouts: Timeouts = FAST, secure: bool = False,
                 steps: int = 20, step_time: float = 0.02) -> None:
        self.steps, self.step_time = steps, step_time
        self.procs: dict[int, subprocess.Popen] = {}
        self.incarnations: dict[int, int] = {}
        super().__init__(tmp, world_size, timeouts, secure, agent=self._on_order)

    def spawn(self, rank: int, restart_count: int = 0, **extra: str) -> subprocess.Popen:
        t = self.timeouts
        env = self.rank_environment(rank, restart_count, MINDFT_REGISTER_TIMEOUT=str(t.register),
                                    MINDFT_CONNECT_RETRIES=str(t.connect_retries),
                                    COORD_DIR=str(self.tmp), COORD_STEPS=str(self.steps),
                                    COORD_STEP_TIME=str(self.step_time), **extra)
        proc = self.start([str(RANK_SCRIPT)], env, self.tmp / f"stderr-{rank}.txt")
        self.procs[rank] = proc
        self.incarnations[rank] = restart_count
        return proc

    def _on_order(self, message) -> None:
        """The node agent's part after a hot reset: a new incarnation of a rank that left its device."""
        if isinstance(message, RankOrder) and message.kind is OrderKind.START:
            self.spawn(message.rank, restart_count=self.incarnations.get(message.rank, 0) + 1)

    def spawn_all(self, **per_rank: dict[str, str]) -> None:
        for rank in range(self.world_size):
            self.spawn(rank, **per_rank.get(f"r{rank}", {}))

    def rank_step(self, rank: int) -> int:
        replica = self.tmp / f"replica-{rank}.json"
        try:
            return json.loads(replica.read_text())["step"]
        except (FileNotFoundError, ValueError):
            return -1

    def events(self, rank: int) -> list[dict]:
        path = self.tmp / f"events-{rank}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_ranks(self, timeout: float = 30.0) -> dict[int, int]:
        codes = {}
        for rank, proc in self.procs.items():
            codes[rank] = proc.wait(timeout)
        return codes


make_job = job_fixture(Job)


def assert_all_done(job: Job, steps: Optional[int] = None) -> None:
    steps = job.steps if steps is None else steps
    job.wait_ranks()  # the controller is DONE once FINISH is sent; a rank writes its last event after
    for rank in range(job.world_size):
        done = [e for e in job.events(rank) if e["event"] == "done"]
        assert done, f"rank {rank} never finished: {job.events(rank)[-3:]}"
        assert done[-1]["step"] == steps
        assert done[-1]["state"] == expected_state(steps), f"rank {rank} replayed wrongly"


@pytest.mark.parametrize("world_size", [2, 4])
def test_fault_report_runs_full_recovery(make_job, world_size: int) -> None:
    job = make_job(world_size, steps=12)
    job.spawn_all(r1={"COORD_FAULT_AT": "6:uce"})
    result = job.result()
    assert result.exit_code == EXIT_OK, result.reason
    assert set(job.wait_ranks().values()) == {0}
    assert_all_done(job)
    assert len(job.controller.recovery_times) == 1
    for rank in range(world_size):
        kinds = [e["action"] for e in job.events(rank) if e["event"] == "action"]
        assert kinds == ["pause", "rollback", "resume"], (rank, kinds)
        restored = [e["step"] for e in job.events(rank) if e["event"] == "restored"]
        assert restored == [5], (rank, restored)  # rank 1 failed inside step 6: 5 is held everywhere


def test_killed_rank_is_detected_restarted_and_caught_up(make_job) -> None:
    job = make_job(3, steps=40, step_time=0.03)
    job.spawn_all()
    job.wait_for(lambda: job.rank_step(1) >= 5, "rank 1 to reach step 5")
    victim = job.procs[1]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    job.wait_for(lambda: job.status().state == ControllerState.REPAIRING.value, "the job to pause")
    status = job.status()
    assert status.ranks[1].state == "dead"
    assert "HANG" in status.reason  # silent: the controller cannot know it was killed
    paused_at = {r: job.rank_step(r) for r in (0, 2)}
    time.sleep(0.2)
    assert {r: job.rank_step(r) for r in (0, 2)} == paused_at  # the others really stopped
    job.spawn(1, restart_count=1)
    result = job.result()
    assert result.exit_code == EXIT_OK, result.reason
    assert set(job.wait_ranks().values()) == {0}
    assert_all_done(job)
    assert job.controller.latest_status().ranks[1].restarts == 1
    assert job.controller.latest_status().ranks[1].incarnation == 1
    registered = [e for e in job.events(1) if e["event"] == "registered"]
    assert [e["incarnation"] for e in registered] == [0, 1]
    # The restarted rank's new replica endpoint reached its peers with ROLLBACK.
    for rank in (0, 2):
        restored = [e for e in job.events(rank) if e["event"] == "restored"]
        assert restored and restored[-1]["endpoints"]["1"] == "fake://1/1"


def test_launcher_exit_report_marks_rank_dead_at_once(make_job) -> None:
    job = make_job(2, steps=40, step_time=0.03,
                   timeouts=Timeouts(heartbeat_interval=0.05, heartbeat_misses=200, register=30.0,
                                     pause=10.0, repair=15.0, rollback=10.0, resume=10.0))
    job.spawn_all()
    job.wait_for(lambda: job.rank_step(1) >= 3, "rank 1 to reach step 3")
    victim = job.procs[1]
    victim.kill()
    victim.wait(10)
    # dead_after is 10 s here, so only the launcher's report can make this quick.
    reply = request(job.config, ProcessExit(1, -9, victim.pid))
    assert reply.ok
    status = job.status()
    assert status.state in (ControllerState.PAUSING.value, ControllerState.REPAIRING.value)
    assert "PROCESS_DIED" in status.reason
    job.spawn(1, restart_count=1)
    assert job.result().exit_code == EXIT_OK
    assert_all_done(job)


def test_stopped_rank_is_detected_as_hung(make_job) -> None:
    job = make_job(2, steps=40, step_time=0.03)
    job.spawn_all()
    job.wait_for(lambda: job.rank_step(1) >= 3, "rank 1 to reach step 3")
    hung = job.procs[1]
    hung.send_signal(signal.SIGSTOP)
    job.wait_for(lambda: job.status().state == ControllerState.REPAIRING.value, "the hang to be detected")
    status = job.status()
    assert status.ranks[1].state == "dead"
    assert "rank 1 HANG" in status.reason
    hung.kill()  # cleanup also SIGCONTs; a stopped process still dies on SIGKILL
    hung.wait(10)
    job.spawn(1, restart_count=1)
    assert job.result().exit_code == EXIT_OK
    assert_all_done(job)


def test_garbage_and_wrong_key_peers_are_refused(make_job) -> None:
    job = make_job(2, secure=True, steps=15)
    # Raw bytes that are not even ZMTP.
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", os.urandom(512)):
        with socket.create_connection(("127.0.0.1", job.port), timeout=2) as raw:
            raw.sendall(junk)
    context = zmq.Context()
    try:
        intruders = []
        wrong = generate_keys(job.tmp / "other.key")
        for keys in (wrong, None):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                secure_client(sock, keys)
            sock.connect(job.controller.endpoint)
            sock.send(encode(StatusRequest()))
            intruders.append(sock)
        for sock in intruders:
            assert sock.poll(1000) == 0, "a peer without the job key got an answer"
    finally:
        context.destroy(0)
    job.spawn_all(r0={"COORD_FAULT_AT": "4:communication"})
    result = job.result()
    assert result.exit_code == EXIT_OK, result.reason
    assert_all_done(job)


def test_garbage_frames_from_a_connected_peer_are_dropped(make_job) -> None:
    job = make_job(2, steps=10)
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)  # the frames must leave before close (connect is asynchronous)
        sock.connect(job.controller.endpoint)
        sock.send(b"\xff\xfe not json")
        sock.send(b'{"v":99,"msg":"status_request"}')
        sock.send(b'{"v":1,"msg":"launch_missiles"}')
        sock.send(b'{"v":1,"msg":"heartbeat","rank":0,"incarnation":0,"step":"x"}')
        sock.send_multipart([b"two", b"frames"])
        sock.send(b"x" * (8 * 1024 * 1024))  # over MAX_FRAME: libzmq drops the connection
        sock.close()  # lingers until the frames are out
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(job.controller.endpoint)
        sock.send(encode(StatusRequest()))
        assert sock.poll(5000), "controller stopped answering after garbage"
    finally:
        context.destroy(0)
    deadline = time.monotonic() + 10  # the status came on another connection: the garbage may trail it
    while job.controller.dropped_frames < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.controller.dropped_frames >= 5
    job.spawn_all(r1={"COORD_FAULT_AT": "3:uce"})
    assert job.result().exit_code == EXIT_OK
    assert_all_done(job)


# Every phase times out the same way (tests/unit/flow/test_ladder.py): here one does, on real timers,
# and the ranks really dump and exit.
@pytest.mark.parametrize("phase", ["pause"])
def test_phase_timeout_escalates_to_dump_and_exit(make_job, phase: str) -> None:
    timeouts = Timeouts(heartbeat_interval=0.05, heartbeat_misses=40, register=30.0, pause=1.5,
                        repair=10.0, rollback=1.5, resume=1.5)
    job = make_job(2, steps=30, timeouts=timeouts)
    job.spawn_all(r0={"COORD_FAULT_AT": "4:uce"}, r1={"COORD_IGNORE": phase})
    result = job.result()
    state = {"pause": "PAUSING", "rollback": "ROLLBACK", "resume": "RESUMING"}[phase]
    assert result.exit_code == EXIT_FAILED
    assert f"{state} timed out after 1.5 s (timeouts.{phase})" in result.reason
    assert "waiting for rank 1" in result.reason  # who
    assert "rank 0 UCE in step 4" in result.reason  # what failed, where
    assert job.controller.state is ControllerState.FAILED
    assert job.wait_ranks() == {0: EXIT_DUMPED, 1: EXIT_DUMPED}
    for rank in (0, 1):
        assert [e for e in job.events(rank) if e["event"] == "dump"]


def test_repair_timeout_when_a_dead_rank_never_returns(make_job) -> None:
    timeouts = Timeouts(heartbeat_interval=0.05, heartbeat_misses=30, register=30.0, pause=5.0,
                        repair=1.0, rollback=5.0, resume=5.0)
    job = make_job(2, steps=40, step_time=0.03, timeouts=timeouts)
    job.spawn_all()
    job.wait_for(lambda: job.rank_step(1) >= 3, "rank 1 to reach step 3")
    job.procs[1].kill()
    result = job.result()
    assert result.exit_code == EXIT_FAILED
    assert "REPAIRING timed out" in result.reason and "rank 1 (its process is gone; a new one has not registered)" in result.reason
    assert job.procs[0].wait(30) == EXIT_DUMPED


def test_second_fault_during_recovery_restarts_it(make_job) -> None:
    job = make_job(3, steps=12)
    job.spawn_all(r2={"COORD_FAULT_AT": "5:uce"}, r0={"COORD_ROLLBACK_FAULT": "1"})
    result = job.result()
    assert result.exit_code == EXIT_OK, result.reason
    assert_all_done(job)
    assert job.controller.latest_status().round == 2
    assert len(job.controller.recovery_times) == 1  # one recovery, restarted once
    rounds = {e["round"] for e in job.events(1) if e["event"] == "action" and e["action"] == "pause"}
    assert rounds == {1, 2}


def test_injected_fault_is_relayed_to_the_rank(make_job) -> None:
    job = make_job(2, steps=40, step_time=0.03)
    job.spawn_all()
    job.wait_for(lambda: job.rank_step(0) >= 3, "rank 0 to reach step 3")
    reply = request(job.config, InjectRequest(0, FaultKind.UCE, "from the test"))
    assert reply.ok
    assert job.result().exit_code == EXIT_OK
    assert_all_done(job)
    actions = [e["action"] for e in job.events(0) if e["event"] == "action"]
    assert actions[:4] == ["inject_fault", "pause", "rollback", "resume"]


def test_processor_gives_up_after_bounded_retries() -> None:
    port = free_port()  # where nothing listens
    timeouts = Timeouts(heartbeat_interval=0.05, heartbeat_misses=3, connect_retries=3, register=30.0)
    # Started by mindft-launch: it keeps trying for connect_retries silent periods.
    processor = Processor(MindftConfig(rank=0, world_size=1, controller_port=port, insecure=True,
                                       timeouts=timeouts, launcher_pid=os.getpid()))
    try:
        started = time.monotonic()
        with pytest.raises(ProcessorError, match="no mindft controller answers .* start the job with mindft-launch"):
            processor.register()
        assert 0.45 <= time.monotonic() - started < 10  # 3 periods of 0.15 s, long before timeouts.register
    finally:
        processor.close()
    # Started by hand: one silent period is enough to say so.
    processor = Processor(MindftConfig(rank=0, world_size=1, controller_port=port, insecure=True,
                                       timeouts=timeouts))
    try:
        started = time.monotonic()
        with pytest.raises(ProcessorError, match="waited 0.15 s"):
            processor.register()
    finally:
        processor.close()


def test_status_command_counts_recoveries_not_rounds(make_job) -> None:
    """Two rounds (a second fault during the first recovery) are one recovery; then a second one."""
    from click.testing import CliRunner

    from mindft.cli.main import main

    job = make_job(3, steps=400, step_time=0.02)
    job.spawn_all(r2={"COORD_FAULT_AT": "5:uce"}, r0={"COORD_ROLLBACK_FAULT": "1"})
    job.wait_for(lambda: job.status().recoveries == 1 and job.status().state == "NORMAL", "the first recovery")
    assert job.status().round == 2
    reply = request(job.config, InjectRequest(1, FaultKind.UCE, "second"))
    assert reply.ok
    job.wait_for(lambda: job.status().recoveries == 2 and job.status().state == "NORMAL", "the second recovery")
    result = CliRunner().invoke(main, ["status", "--address", f"127.0.0.1:{job.port}", "--insecure"])
    assert result.exit_code == 0, result.output
    assert "recoveries: 2" in result.output and "round" not in result.output


def test_stand_alone_controller_help_and_ctrl_c() -> None:
    help_ = subprocess.run([sys.executable, "-m", "mindft.controller", "--help"], capture_output=True, text=True,
                           timeout=30)
    assert help_.returncode == 0 and "usage: python -m mindft.controller" in help_.stdout
    bad = subprocess.run([sys.executable, "-m", "mindft.controller", "--bogus"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == ExitCode.USAGE
    port = free_port()
    env = environment(MINDFT_INSECURE="1", MS_TFT_PORT=str(port), MS_WORKER_NUM="2")
    proc = subprocess.Popen([sys.executable, "-m", "mindft.controller"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait until it answers
            try:
                channel.request(f"127.0.0.1:{port}", None, StatusRequest(), timeout=0.5)
                break
            except channel.ControllerUnreachable:
                continue
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == ExitCode.INTERRUPTED
    assert "Traceback" not in err and "interrupted" in err


def test_the_job_chooses_one_cadence_for_every_rank(make_job) -> None:
    # 20 ms steps and 1 ms snapshots: the 1% budget asks for every 5th step. Both ranks switch
    # at the step the controller announces, capture the same steps, and roll back to one of them.
    job = make_job(2, steps=40)
    job.spawn_all(r0={"COORD_COST": "0.02:0.001"}, r1={"COORD_COST": "0.018:0.0008", "COORD_FAULT_AT": "33:uce"})
    result = job.result()
    assert result.exit_code == EXIT_OK, result.reason
    assert_all_done(job)
    segments = job.controller.job.tuner.schedule.segments
    assert len(segments) == 2 and segments[1][1] == 5, segments
    switch = segments[1][0]
    # A rank ahead of the faulty one may capture a step past the fault (its window is open) and
    # capture it again on the replay: the steps captured are the same, not their counts.
    captured = [sorted({e["captured"] for e in job.events(rank) if e["event"] == "capture"}) for rank in range(2)]
    assert captured[0] == captured[1], captured
    after = [s for s in captured[0] if s >= switch]
    assert after and all(s % 5 == switch % 5 for s in after) and after[-1] >= 35, after
    assert all(s == 1 + i for i, s in enumerate(s for s in captured[0] if s < switch)), captured[0]
    restored = [e["step"] for e in job.events(1) if e["event"] == "restored"]
    assert len(restored) == 1 and restored[0] in after and restored[0] <= 32, restored
