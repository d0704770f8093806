"""The simulated ranks and node agents the coordination benchmark drives; each a subprocess.

A worker holds thousands of simulated peers over few sockets: one ROUTER socket with one TCP
connection per rank (``--sim-worker``) or per node agent relaying its ranks (``--relay-worker``),
driven from one thread and speaking mindft's wire protocol, or the same connections answering
bare frames for the raw ZeroMQ floor (``--floor-worker``). bench/coordination.py starts them:

    python bench/sim_ranks.py --sim-worker FIRST COUNT PORT ROUNDS KEY_FILE STATS
    python bench/sim_ranks.py --relay-worker FIRST COUNT NPROC WORLD PORT ROUNDS KEY_FILE STATS
    python bench/sim_ranks.py --floor-worker FIRST COUNT PORT NPROC
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import zmq

from mindft.config import MindftConfig, Timeouts
from mindft.net.keys import CurveKeys, job_keys, secure_client
from mindft.protocol import (Ack, AckBatch, Action, ActionKind, Done, Register, RegisterAck, StepBatch, decode,
                             encode, encode_heartbeat)

# Generous liveness for the benchmark: a loaded 2-core box must not declare ranks dead.
SIM_TIMEOUTS = Timeouts(heartbeat_interval=2.0, heartbeat_misses=60, register=300.0, pause=120.0,
                        repair=120.0, rollback=120.0, resume=120.0)
RANK_NAME = "rank{}.inc0"  # a rank's DEALER identity (its incarnation 0)
NODE_NAME = "agent/{}/sim"  # a simulated node agent's identity: no RELAY_SEPARATOR in it
# Rounds run before the measured ones. The first fault finds every rank idle since the start
# barrier, each heartbeating on the same rhythm (they all heard its answer at once): a burst
# of pings a training job, whose ranks report every step, does not send.
WARMUP = 1
HELD = (0,)  # every rank holds the snapshot of step 0, so every round rolls back to it
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)


def rank_connections(context: zmq.Context, first: int, count: int, port: str,
                     keys: Optional[CurveKeys] = None, name: str = RANK_NAME) -> tuple[zmq.Socket, Callable[..., Any]]:
    """One ROUTER socket holding one TCP connection per simulated rank ``first … first+count-1``
    (or per simulated node agent: ``name`` is then :data:`NODE_NAME`).

    Each connection introduces itself to the controller as ``rank<R>.inc0``, as a rank's
    DEALER does, so the controller sees one peer per rank; locally it is addressed by its
    index (``b"%d" % index``). One socket for thousands of ranks keeps the simulation's own
    cost small: a DEALER per rank costs a mailbox, an epoll entry and a few system calls per
    frame on the simulation's side (the box's two cores are shared with the controller),
    where a real rank pays them in its own process. Returns the socket and its backend
    ``send`` (zmq.Socket.send only adds draft-API arguments to it).
    """
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a frame that cannot be queued raises, never vanishes
    secure_client(sock, keys)
    for index in range(count):
        sock.setsockopt(zmq.ROUTING_ID, name.format(first + index).encode())  # what the controller sees
        sock.setsockopt(zmq.CONNECT_ROUTING_ID, b"%d" % index)  # how this side addresses the connection
        sock.connect(f"tcp://127.0.0.1:{port}")
    return sock, super(zmq.Socket, sock).send


class Hearing:
    """What a worker's simulated peers heard: each frame decoded once (a broadcast is the same frame for
    every peer; a real one decodes it in its own process, so decoding it once here keeps the
    simulation from serializing work that is parallel in a real job), frames counted by kind and by
    period ("rounds" from a peer's first measured PAUSE until its Done, "setup" the rest), and
    ``stats + ".ready"`` created once every peer heard the start barrier's answer.

    And when each peer heartbeats: like a Processor (and a node agent), only after an interval in
    which it sent nothing, or heard nothing (then at most once per interval); the controller answers
    each heartbeat. :meth:`beats_due` says who, checked every quarter of an interval."""

    def __init__(self, count: int, stats: str, interval: float = SIM_TIMEOUTS.heartbeat_interval) -> None:
        self.stats = stats
        self.decoded: dict[bytes, object] = {}
        self.received: dict[str, dict[str, int]] = {"setup": {}, "rounds": {}}
        self.in_rounds = [False] * count
        self.acked = [False] * count  # heard the start barrier's RegisterAck
        self.waiting = count
        self.interval = interval
        started = time.monotonic()
        self.last_sent = [started] * count
        self.last_heard = [started] * count
        self.last_beat = [started] * count
        self.next_check = started + interval / 4

    def beats_due(self, now: float, ended: list) -> list[int]:
        """The peers (but those ``ended``) whose heartbeat is due at ``now``, each counted as having sent it."""
        if now < self.next_check:
            return []
        interval = self.interval
        self.next_check = now + interval / 4
        last_sent, last_heard, last_beat = self.last_sent, self.last_heard, self.last_beat
        due = [index for index in range(len(last_sent)) if not ended[index] and (
            now - last_sent[index] >= interval or now - max(last_heard[index], last_beat[index]) >= interval)]
        for index in due:
            last_sent[index] = last_beat[index] = now
        return due

    def heard(self, index: int, frame: bytes, resumed: int, now: float) -> object:
        """Peer ``index``, after ``resumed`` rounds, heard ``frame`` at ``now``: the message."""
        self.last_heard[index] = now
        message = self.decoded.get(frame)
        if message is None:
            message = decode(frame)
            if len(self.decoded) > 64:
                self.decoded.clear()
            self.decoded[frame] = message
        kind_of = type(message)
        if kind_of is Action and message.kind is ActionKind.PAUSE and resumed == WARMUP:
            self.in_rounds[index] = True
        counts = self.received["rounds" if self.in_rounds[index] else "setup"]
        counts[kind_of.__name__] = counts.get(kind_of.__name__, 0) + 1
        if kind_of is RegisterAck and not self.acked[index]:
            self.acked[index] = True
            self.waiting -= 1
            if self.waiting == 0:
                Path(self.stats + ".ready").touch()
        return message


def sim_worker_main(first: int, count: int, port: int, rounds: int, key_file: str, stats: str) -> None:
    """``count`` ranks starting at ``first`` (one connection each, see :func:`rank_connections`),
    driven from one thread; creates ``stats + ".ready"`` once every one of them heard the start
    barrier's answer, and writes how many frames of each kind it sent and received to ``stats``
    (JSON)."""
    keys = job_keys(MindftConfig(key_file=Path(key_file) if key_file else None, insecure=not key_file))
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 1000)
    sock, send = rank_connections(context, first, count, str(port), keys)
    ids = [b"%d" % index for index in range(count)]
    for index, rank in enumerate(range(first, first + count)):
        send(ids[index], _MORE)
        send(encode(Register(rank, 0, os.getpid(), (0,), "")), 0)
    # Per rank, by its index (rank = first + index).
    resumed = [0] * count
    finished = [False] * count  # got FINISH (after its Done)
    hearing, left = Hearing(count, stats), count
    in_rounds, received, last_sent = hearing.in_rounds, hearing.received, hearing.last_sent
    # Acks from a byte template (checked against encode() once): the simulation stands in
    # for thousands of processes, so its own per-message cost must stay small. Like a
    # follower, a rank acknowledges PAUSE with its position and held steps, ROLLBACK with
    # the step it restored, RESUME with the step it resumes after.
    templates = {kind: (encode(Ack(-12345, kind, -23456, HELD, -6789))
                        .replace(b"-12345", b"%d").replace(b"-23456", b"%d").replace(b"-6789", b"%d"))
                 for kind in (ActionKind.PAUSE, ActionKind.ROLLBACK, ActionKind.RESUME)}

    def ack_frame(rank: int, kind: ActionKind, step: int, round_: int) -> bytes:
        return templates[kind] % (rank, step, round_)

    assert ack_frame(first, ActionKind.ROLLBACK, 3, 7) == encode(Ack(first, ActionKind.ROLLBACK, 3, HELD, 7))
    position = 0  # every simulated rank stays at step 0
    # Frames of each kind per period: "rounds" from a rank's first measured PAUSE until its
    # Done, "setup" the registration and the warm-up before and the wait for FINISH after.
    sent = {"setup": {"heartbeat": 0, "ack": 0, "other": count}, "rounds": {"heartbeat": 0, "ack": 0}}
    recv = sock.recv
    while left:
        if sock.poll(100):
            now = time.monotonic()
            while True:
                try:
                    local = recv(_NOBLOCK)
                except zmq.Again:
                    break
                frame = recv(_NOBLOCK)  # the controller sends one frame per message
                index = int(local)
                if finished[index]:
                    continue
                rank = first + index
                message = hearing.heard(index, frame, resumed[index], now)
                kind_of = type(message)
                if kind_of is not Action:
                    continue  # heartbeats and Progress: nothing to answer
                kind = message.kind
                if kind is ActionKind.FINISH:
                    finished[index] = True
                    left -= 1
                elif kind is ActionKind.DUMP_AND_EXIT:
                    raise RuntimeError(f"rank {rank}: the controller ended the job: {message.reason}")
                elif kind in (ActionKind.PAUSE, ActionKind.ROLLBACK, ActionKind.RESUME):
                    step = position if kind is ActionKind.PAUSE else message.step
                    send(local, _MORE)
                    send(ack_frame(rank, kind, step, message.round), 0)
                    last_sent[index] = now
                    sent["rounds" if in_rounds[index] else "setup"]["ack"] += 1
                    if kind is ActionKind.RESUME:
                        resumed[index] += 1
                        if resumed[index] >= rounds:
                            send(local, _MORE)
                            send(encode(Done(rank, position)), 0)
                            sent["setup"]["other"] += 1
                            in_rounds[index] = False
        for index in hearing.beats_due(time.monotonic(), finished):
            send(ids[index], _MORE)
            send(encode_heartbeat(first + index, 0, position), 0)
            sent["rounds" if in_rounds[index] else "setup"]["heartbeat"] += 1
    sock.close()
    context.term()
    Path(stats).write_text(json.dumps({"sent": sent, "received": received}))


def node_ranks(node: int, nproc: int, world: int) -> tuple[int, ...]:
    """The ranks node ``node`` relays: ``nproc`` of them, fewer on the last node of a world that
    ``nproc`` does not divide."""
    return tuple(range(node * nproc, min(world, (node + 1) * nproc)))


def relay_worker_main(first: int, count: int, nproc: int, world: int, port: int, rounds: int, key_file: str,
                      stats: str) -> None:
    """``count`` simulated node agents starting at node ``first``, each relaying the ranks of
    :func:`node_ranks` over its one connection (see :func:`rank_connections`), driven from one
    thread; the ``.ready`` and ``stats`` files as :func:`sim_worker_main`'s.

    The wire seen from a node agent: up, a rank's own message is [its identity, frame] and the
    node's aggregate one frame; down, [a rank's identity, frame] is for that rank, [b"", frame]
    for every rank of the node (a broadcast crosses the link once) and a lone frame for the agent
    itself (the answer to its heartbeat). A node registers its ranks as relayed Registers,
    acknowledges each broadcast PAUSE / ROLLBACK / RESUME with one AckBatch of its ranks (the
    steps and held steps a flat simulated rank acknowledges with), relays each rank's Done
    after the last round, and heartbeats, like a flat simulated rank, only after an interval
    with nothing sent or heard: one StepBatch of its ranks at their position.
    """
    keys = job_keys(MindftConfig(key_file=Path(key_file) if key_file else None, insecure=not key_file))
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 1000)
    sock, send = rank_connections(context, first, count, str(port), keys, NODE_NAME)
    ids = [b"%d" % index for index in range(count)]
    members = [node_ranks(first + index, nproc, world) for index in range(count)]
    position = 0  # every simulated rank stays at step 0
    for index, ranks in enumerate(members):
        for rank in ranks:
            send(ids[index], _MORE)
            send(RANK_NAME.format(rank).encode(), _MORE)
            send(encode(Register(rank, 0, os.getpid(), (0,), "")), 0)
    # Per node, frames from byte templates (checked against encode() once): the simulation
    # stands in for thousands of agents, so its own per-message cost must stay small.
    phases = (ActionKind.PAUSE, ActionKind.ROLLBACK, ActionKind.RESUME)

    def template(message: object) -> bytes:
        return encode(message).replace(b"-23456", b"%d").replace(b"-6789", b"%d")
    acks = [{kind: template(AckBatch(kind, -23456, ranks, HELD, -6789)) for kind in phases} for ranks in members]
    beats = [template(StepBatch(ranks, (position,) * len(ranks), -6789)) for ranks in members]
    assert acks[0][ActionKind.ROLLBACK] % (3, 7) == encode(AckBatch(ActionKind.ROLLBACK, 3, members[0], HELD, 7))
    assert beats[0] % 7 == encode(StepBatch(members[0], (position,) * len(members[0]), 7))
    resumed = [0] * count
    finished = [0] * count  # how many of its ranks got FINISH
    done = [False] * count  # every one of its ranks got FINISH
    last_round = [0] * count  # the round of the last action it heard: its heartbeat's
    hearing, left = Hearing(count, stats), count
    in_rounds, received, last_sent = hearing.in_rounds, hearing.received, hearing.last_sent
    sent = {"setup": {"heartbeat": 0, "ack": 0, "other": sum(map(len, members))}, "rounds": {"heartbeat": 0, "ack": 0}}
    recv, more = sock.recv, sock.getsockopt
    while left:
        if sock.poll(100):
            now = time.monotonic()
            while True:
                try:
                    local = recv(_NOBLOCK)
                except zmq.Again:
                    break
                frame, to = recv(_NOBLOCK), None  # a lone frame: for the agent itself
                if more(_RCVMORE):  # [a rank's identity, or b"" for all of the node's ranks; the frame]
                    to, frame = frame, recv(_NOBLOCK)
                index = int(local)
                if done[index]:
                    continue
                message = hearing.heard(index, frame, resumed[index], now)
                kind_of = type(message)
                if kind_of is not Action:
                    continue  # heartbeats and Progress: nothing to answer
                kind = message.kind
                last_round[index] = message.round
                if kind is ActionKind.FINISH:
                    finished[index] += len(members[index]) if to == b"" else 1
                    if finished[index] >= len(members[index]):
                        done[index] = True
                        left -= 1
                elif kind is ActionKind.DUMP_AND_EXIT:
                    raise RuntimeError(f"node {first + index}: the controller ended the job: {message.reason}")
                elif kind in phases:
                    step = position if kind is ActionKind.PAUSE else message.step
                    send(local, _MORE)
                    if to:  # one rank's own action (none in this benchmark's rounds): its own Ack
                        rank = int(to[4:to.index(b".")])
                        send(to, _MORE)
                        send(encode(Ack(rank, kind, step, HELD, message.round)), 0)
                    else:
                        send(acks[index][kind] % (step, message.round), 0)
                    last_sent[index] = now
                    sent["rounds" if in_rounds[index] else "setup"]["ack"] += 1
                    if kind is ActionKind.RESUME and not to:
                        resumed[index] += 1
                        if resumed[index] >= rounds:
                            for rank in members[index]:
                                send(local, _MORE)
                                send(RANK_NAME.format(rank).encode(), _MORE)
                                send(encode(Done(rank, position)), 0)
                            sent["setup"]["other"] += len(members[index])
                            in_rounds[index] = False
        for index in hearing.beats_due(time.monotonic(), done):
            send(ids[index], _MORE)
            send(beats[index] % last_round[index], 0)
            sent["rounds" if in_rounds[index] else "setup"]["heartbeat"] += 1
    sock.close()
    context.term()
    Path(stats).write_text(json.dumps({"sent": sent, "received": received}))


def floor_worker_main(first: int, count: int, port: int, nproc: int = 0) -> None:
    """The same connections as a simulation worker (``nproc`` > 0: a relay worker's, one per
    node), driven the same way, answering every message with a fixed frame."""
    context = zmq.Context()
    sock, send = rank_connections(context, first, count, str(port), name=NODE_NAME if nproc else RANK_NAME)
    for index in range(count):
        send(b"%d" % index, _MORE)
        send(b"hello", 0)
    recv, more = sock.recv, sock.getsockopt
    while True:
        sock.poll(1000)
        while True:
            try:
                local = recv(_NOBLOCK)
            except zmq.Again:
                break
            frame = recv(_NOBLOCK)
            if nproc:  # a broadcast to a node is [b"", frame]
                while more(_RCVMORE):
                    frame = recv(_NOBLOCK)
            if frame == b"stop":
                context.destroy(0)
                return
            send(local, _MORE)
            send(b"ack", 0)

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workers = parser.add_mutually_exclusive_group(required=True)
    workers.add_argument("--sim-worker", nargs=6, metavar=("FIRST", "COUNT", "PORT", "ROUNDS", "KEY_FILE", "STATS"),
                         help="simulated ranks, one connection each")
    workers.add_argument("--floor-worker", nargs=4, metavar=("FIRST", "COUNT", "PORT", "NPROC"),
                         help="the bare-zmq floor's peers (NPROC > 0: one per node)")
    workers.add_argument("--relay-worker", nargs=8, help="simulated node agents relaying NPROC ranks each",
                         metavar=("FIRST", "COUNT", "NPROC", "WORLD", "PORT", "ROUNDS", "KEY_FILE", "STATS"))
    args = parser.parse_args()
    if args.sim_worker:
        first, count, port, rounds, key_file, stats = args.sim_worker
        sim_worker_main(int(first), int(count), int(port), int(rounds), key_file, stats)
    elif args.floor_worker:
        first, count, port, nproc = map(int, args.floor_worker)
        floor_worker_main(first, count, port, nproc)
    else:
        first, count, nproc, world, port, rounds = map(int, args.relay_worker[:6])
        relay_worker_main(first, count, nproc, world, port, rounds, *args.relay_worker[6:])


if __name__ == "__main__":
    main()
