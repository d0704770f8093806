"""The controller on a thread of this process and Processors of this process over real ZeroMQ on
127.0.0.1: the start barrier's timeout, a Processor that waits for a late controller, a pause
that finds a capture step captured, a large broadcast sent whole (no process started; the jobs
of real rank processes: tests/integration/controller/test_coordination.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest
import zmq

from harness import free_port, start_controller
from mindft.config import MindftConfig, Timeouts
from mindft.controller import Controller
from mindft.exitcodes import ExitCode
from mindft.flow import JobState
from mindft.protocol import ActionKind, FaultKind, Register, RegisterAck, decode, encode
from mindft.rank.loop import RankLoop
from mindft.rank.processor import Processor, ProcessorError

EXIT_OK, EXIT_FAILED = ExitCode.OK, ExitCode.FAILED
ControllerState = JobState


def test_start_barrier_times_out_naming_missing_ranks(tmp_path: Path) -> None:
    config = MindftConfig(world_size=3, controller_port=0, insecure=True,
                          timeouts=Timeouts(heartbeat_interval=0.05, register=1.0))
    controller, client = start_controller(config)
    processor = Processor(dataclasses.replace(client, rank=0))
    try:
        with pytest.raises(ProcessorError, match="ended the job before registration completed"):
            processor.register()
        result = controller.join(10)
        assert result is not None and result.exit_code == EXIT_FAILED
        assert "rank(s) [1, 2] (not registered)" in result.reason
        action = processor.wait_action(5)
        assert action.kind is ActionKind.DUMP_AND_EXIT
    finally:
        processor.close()
        controller.stop()


def test_processor_waits_for_a_late_controller(tmp_path: Path) -> None:
    port = free_port()
    timeouts = Timeouts(heartbeat_interval=0.05, heartbeat_misses=20, connect_retries=10, register=10.0)
    processor = Processor(MindftConfig(rank=0, world_size=1, controller_port=port, insecure=True,
                                       timeouts=timeouts))
    controller = None
    try:
        registered = {}
        thread = threading.Thread(target=lambda: registered.update(ack=processor.register()))
        thread.start()
        time.sleep(0.5)  # a few reconnect attempts happen meanwhile
        controller = Controller(MindftConfig(world_size=1, controller_port=port, insecure=True,
                                             timeouts=timeouts))
        controller.start()
        thread.join(10)
        assert registered["ack"].world_size == 1
        processor.finished(1)
        assert RankLoop(processor, hooks=None).finish(1) is None  # FINISH: nothing to obey
        assert controller.join(5).exit_code == EXIT_OK
    finally:
        processor.close()
        if controller is not None:
            controller.stop()


@contextlib.contextmanager
def two_registered_ranks(**config: object) -> Iterator[tuple[Controller, MindftConfig, list[Processor]]]:
    """A controller thread and two Processors of this process, registered; all closed after."""
    timeouts = Timeouts(heartbeat_interval=0.05, heartbeat_misses=40, register=10.0, pause=10.0)
    server = MindftConfig(world_size=2, controller_port=0, insecure=True, timeouts=timeouts, **config)
    controller, client = start_controller(server)
    processors = [Processor(dataclasses.replace(client, rank=r)) for r in range(2)]
    try:
        registering = [threading.Thread(target=p.register) for p in processors]
        for thread in registering:
            thread.start()
        for thread in registering:
            thread.join(10)
        assert controller.state is ControllerState.NORMAL
        yield controller, client, processors
    finally:
        for processor in processors:
            processor.close()
        controller.stop()


class RecordingHooks:
    """A rank's snapshots as a list of steps, and what the flow asked of it, in order."""

    def __init__(self) -> None:
        self.held: list[int] = []
        self.calls: list[str] = []

    def capture(self, step: int) -> None:
        self.held = [*self.held, step][-2:]
        self.calls.append(f"capture {step}")

    def settle(self) -> list[int]:
        self.calls.append("settle")
        return self.held

    def restore(self, step: int) -> list[int]:
        self.calls.append(f"restore {step}")
        return self.held

    def resume(self, step: int) -> None:
        self.calls.append(f"resume {step}")


def test_a_pause_pending_at_a_capture_step_finds_that_step_captured() -> None:
    """Rank 0 faults in step 4 while rank 1 is finishing step 3: rank 1 captures step 3 (its
    window is open) before it follows the PAUSE, so the job rolls back to 3, not 2."""
    hooks = [RecordingHooks(), RecordingHooks()]
    resumed: dict[int, Optional[int]] = {}
    with two_registered_ranks(snapshot_every=1) as (controller, _, processors):
        loops = [RankLoop(processor, hook) for processor, hook in zip(processors, hooks)]

        def train(rank: int, steps: int) -> None:
            for step in range(1, steps + 1):
                assert loops[rank].end_step(step, hooks[rank].capture) is None

        def faulty_rank_0() -> None:
            train(0, 3)
            resumed[0] = loops[0].fault(FaultKind.UCE, "drill", 4)

        rank_0 = threading.Thread(target=faulty_rank_0)
        rank_0.start()
        train(1, 2)
        deadline = time.monotonic() + 10
        while not processors[1]._actions:  # the PAUSE waits in rank 1's queue
            assert time.monotonic() < deadline, f"no PAUSE reached rank 1; controller {controller.state}"
            time.sleep(0.01)
        resumed[1] = loops[1].end_step(3, hooks[1].capture)
        rank_0.join(10)
        assert resumed == {0: 3, 1: 3}
        assert hooks[1].calls[-4:] == ["capture 3", "settle", "restore 3", "resume 3"]


def test_a_large_broadcast_reaches_every_rank_whole(tmp_path: Path) -> None:
    # The start barrier's RegisterAck carries every rank's endpoint; from 2 kB on the
    # controller sends one shared buffer to every peer instead of a copy each.
    world = 3
    config = MindftConfig(world_size=world, controller_port=0, insecure=True,
                          timeouts=Timeouts(heartbeat_interval=0.5, register=20.0))
    controller = Controller(config)
    controller.start()
    context = zmq.Context()
    endpoints = {rank: f"tcp://10.0.0.{rank}:{29600 + rank}/" + "x" * 3000 for rank in range(world)}
    try:
        socks = []
        for rank in range(world):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, f"rank{rank}.inc0".encode())
            sock.connect(controller.endpoint)
            sock.send(encode(Register(rank, 0, 100 + rank, (0,), endpoints[rank])))
            socks.append(sock)
        frames = []
        for sock in socks:
            assert sock.poll(10_000), "no RegisterAck"
            frames.append(sock.recv())
        assert len(frames[0]) >= 9000 and frames.count(frames[0]) == world
        ack = decode(frames[0])
        assert isinstance(ack, RegisterAck) and ack.endpoints == endpoints
    finally:
        context.destroy(0)
        controller.stop()


def test_routine_orders_are_info_a_hangs_kill_a_warning_and_a_new_round_is_no_self_transition(caplog) -> None:
    import logging

    from mindft.flow import JobState, KillRank, StartRank, Transition

    controller = Controller(MindftConfig(world_size=2, controller_port=0, insecure=True))
    try:
        with caplog.at_level(logging.INFO, logger="mindft.controller"):
            controller._apply([KillRank(0, 100, "every worker restarts: rank 1 UCE in step 9", restart=False),
                               StartRank(0, "every worker restarts"),
                               KillRank(1, 101, "HANG: no message for 3.10 s", restart=True),
                               Transition(JobState.PAUSING, JobState.PAUSING, "rank 0 UCE in step 10")])
    finally:
        controller._close()
    levels = {record.getMessage(): record.levelname for record in caplog.records}
    assert levels["rank=0 order kill: every worker restarts: rank 1 UCE in step 9"] == "INFO"
    assert levels["rank=0 order start: every worker restarts"] == "INFO"
    assert levels["rank=1 order kill: HANG: no message for 3.10 s"] == "WARNING"
    assert "controller state PAUSING again, round 0 (rank 0 UCE in step 10)" in levels
    assert not [message for message in levels if "PAUSING → PAUSING" in message]
