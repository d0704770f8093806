"""Heartbeats only when nothing else flows: a real Processor against a scripted ROUTER, and a
real Controller against a raw DEALER, on 127.0.0.1."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from mindft.config import MindftConfig, Timeouts
from mindft.controller import Controller
from mindft.rank.processor import Processor
from mindft.protocol import Heartbeat, Progress, Register, RegisterAck, StepReport, decode, encode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


class FakeController:
    """A ROUTER that speaks the protocol by hand and records what each peer sent."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seen: list[tuple[bytes, object]] = []

    def pump(self, seconds: float, answer_heartbeats: bool = True, every: float = 0.01,
             each: object = None) -> list[tuple[bytes, object]]:
        """Receive for ``seconds``; ``each()`` runs every ``every`` seconds; returns what arrived."""
        got = []
        end = time.monotonic() + seconds
        next_each = time.monotonic()
        while (left := end - time.monotonic()) > 0:
            if self.sock.poll(max(0.0, min(left, next_each - time.monotonic())) * 1000):
                while self.sock.poll(0):
                    peer, frame = self.sock.recv_multipart()
                    message = decode(frame)
                    got.append((peer, message))
                    if isinstance(message, Register):
                        self.sock.send_multipart([peer, encode(RegisterAck(1, {0: ""}, "NORMAL"))])
                    elif isinstance(message, Heartbeat) and answer_heartbeats:
                        self.sock.send_multipart([peer, encode(Heartbeat(-1, 0, 0))])
            if each is not None and time.monotonic() >= next_each:
                next_each += every
                each()
        self.seen += got
        return got

    def close(self) -> None:
        self.context.destroy(0)


def test_a_processor_heartbeats_only_when_nothing_else_flows_and_reconnects_when_unanswered() -> None:
    fake = FakeController()
    interval = 0.2
    timeouts = Timeouts(heartbeat_interval=interval, heartbeat_misses=5, connect_retries=100, register=10.0)
    processor = Processor(MindftConfig(rank=0, world_size=1, controller_port=fake.port, insecure=True,
                                       timeouts=timeouts))
    identity = processor.identity
    try:
        thread = threading.Thread(target=processor.register)
        thread.start()
        fake.pump(0.5)
        thread.join(5)
        assert not thread.is_alive()

        def beats(got: list) -> int:
            return sum(1 for peer, message in got if peer == identity and isinstance(message, Heartbeat))

        # Training: a step report from the rank and a Progress from the controller every 20 ms.
        step = iter(range(1, 10_000))

        def train() -> None:
            s = next(step)
            processor.finished(s)
            fake.sock.send_multipart([identity, encode(Progress(s))])
        got = fake.pump(3.0, each=train, every=0.02)
        reports = sum(1 for _, message in got if isinstance(message, StepReport))
        assert reports > 20
        # 15 intervals: a heartbeat every interval would be 15; a loaded box may stall once or twice.
        assert beats(got) <= 2, f"{beats(got)} heartbeats while step reports and Progress flowed"

        # Idle: the rank heartbeats (every interval) and the answers keep it connected.
        got = fake.pump(3.0)
        assert beats(got) >= 5
        assert not any(isinstance(message, Register) for _, message in got)

        # The controller stops answering: the rank keeps pinging, then reconnects and registers again.
        got = []
        deadline = time.monotonic() + 20.0
        while not any(isinstance(message, Register) for _, message in got) and time.monotonic() < deadline:
            got += fake.pump(0.5, answer_heartbeats=False)
        again = [message for _, message in got if isinstance(message, Register)]
        assert again, "no reconnect after dead_after"
        assert beats(got) >= 2
        # Registered again with how far it got: a controller started again learns the job was under way.
        first = next(message for _, message in fake.seen if isinstance(message, Register))
        assert first.progress == -1 and again[0].progress == processor.follower.position > 20
        assert again[0] == Register(0, 0, first.pid, progress=again[0].progress)
    finally:
        processor.close()
        fake.close()


def test_the_controller_broadcasts_no_heartbeat_and_answers_one_to_its_sender() -> None:
    timeouts = Timeouts(heartbeat_interval=0.05, heartbeat_misses=1000, register=30.0)
    controller = Controller(MindftConfig(world_size=1, controller_port=0, insecure=True, timeouts=timeouts))
    controller.start()
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"rank0.inc0")
        sock.connect(controller.endpoint)
        sock.send(encode(Register(0, 0, 1, (0,))))
        assert sock.poll(5000) and isinstance(decode(sock.recv()), RegisterAck)
        # 20 intervals of silence from the rank: the controller sends it nothing (no broadcast per beat).
        assert not sock.poll(1000)
        sock.send(encode(Heartbeat(0, 0, 0)))
        assert sock.poll(5000) and decode(sock.recv()) == Heartbeat(-1, 0, 0)
        assert not sock.poll(300)  # one answer per heartbeat
        # A peer that is not the rank's registered incarnation is not answered: it must register.
        stranger = context.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.IDENTITY, b"rank0.inc7")
        stranger.connect(controller.endpoint)
        stranger.send(encode(Heartbeat(0, 7, 0)))
        assert not stranger.poll(500)
        assert controller.state.value == "NORMAL"
    finally:
        context.destroy(0)
        controller.stop()
