"""The controller's wire to a relay (a node agent carrying its ranks' traffic), over real ZeroMQ on
127.0.0.1, CurveZMQ on: a rank's own message crosses as [its identity, frame], a broadcast once per
relay as [b"", frame], a node's acknowledgement of a phase as one AckBatch (the job's rules for them:
tests/unit/flow/test_relay.py)."""
from __future__ import annotations

from pathlib import Path

import zmq

from harness import start_controller
from mindft.config import MindftConfig, Timeouts
from mindft.flow import DeviceFaulty, DeviceRecovered, JobState
from mindft.net.keys import generate_keys, load_keys, secure_client
from mindft.net import channel
from mindft.protocol import (AckBatch, Action, ActionKind, FaultKind, Heartbeat, InjectRequest, Register, RegisterAck,
                             Reply, StepBatch, decode, encode)

NODES, NPROC = 2, 3


def rank_id(rank: int) -> bytes:
    return f"rank{rank}.inc0".encode()


def test_a_round_through_two_relays_crosses_each_link_once_per_phase(tmp_path: Path) -> None:
    key_file = tmp_path / "job.key"
    generate_keys(key_file)
    config = MindftConfig(world_size=NODES * NPROC, controller_port=0, key_file=key_file,
                          timeouts=Timeouts(heartbeat_interval=1.0, heartbeat_misses=30, register=20.0))
    controller, client = start_controller(config)
    context = zmq.Context()
    relays = []
    try:
        for node in range(NODES):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, f"agent/{node}/1".encode())
            secure_client(sock, load_keys(key_file))
            sock.connect(client.controller_address)
            relays.append(sock)
            for rank in range(node * NPROC, (node + 1) * NPROC):
                sock.send_multipart([rank_id(rank), encode(Register(rank, 0, 100 + rank, (0,)))])

        def heard(sock: zmq.Socket) -> tuple[bytes, object]:
            assert sock.poll(10_000), "nothing from the controller"
            to, frame = sock.recv_multipart()
            return to, decode(frame)

        for sock in relays:  # the start barrier: once per relay, to all of its ranks
            to, message = heard(sock)
            assert to == b"" and isinstance(message, RegisterAck) and message.world_size == NODES * NPROC
            assert not sock.poll(200)
        # Steps and liveness: one StepBatch per node, answered once.
        relays[0].send(encode(StepBatch((0, 1, 2), (0, 0, 0))))
        assert relays[0].poll(5000)
        assert decode(relays[0].recv()) == Heartbeat(-1, 0, 0)
        # A rank's own message and the controller's answer to it alone.
        relays[1].send_multipart([b"", encode(InjectRequest(99, FaultKind.UCE))])  # relayed for no rank: dropped
        answer = channel.request(client.controller_address, load_keys(key_file), InjectRequest(4, FaultKind.UCE), 5.0)
        assert isinstance(answer, Reply) and answer.ok, answer
        to, message = heard(relays[1])
        assert to == rank_id(4) and isinstance(message, Action) and message.kind is ActionKind.INJECT_FAULT
        # A round: every phase reaches each relay once and is acknowledged by one batch per node.
        # The reset and its recovery in one turn, as the reset watcher reports a reset already over:
        # told apart, the recovery may come while the job pauses, which then waits for rank 4 to
        # leave its device (it failed 1 run in 4 on a busy machine).
        controller.on_device_event(DeviceFaulty(4, "0x1", "reset"), DeviceRecovered(4))
        for kind in (ActionKind.PAUSE, ActionKind.ROLLBACK, ActionKind.RESUME):
            for node, sock in enumerate(relays):
                to, message = heard(sock)
                while isinstance(message, Action) and message.kind is ActionKind.LEAVE_DEVICE:
                    to, message = heard(sock)
                assert to == b"" and isinstance(message, Action) and message.kind is kind, message
                sock.send(encode(AckBatch(kind, message.step if kind is not ActionKind.PAUSE else 0,
                                          tuple(range(node * NPROC, (node + 1) * NPROC)), (0,), message.round)))
        for _ in range(100):
            if controller.recovery_times:
                break
            relays[0].poll(50)
        assert len(controller.recovery_times) == 1, controller.latest_status()
        assert controller.latest_status().state == JobState.NORMAL.value
        assert controller.dropped_frames == 1  # the relayed frame that named no rank
    finally:
        for sock in relays:
            sock.close(0)
        controller.stop()
        context.term()
