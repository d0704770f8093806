"""The control channel's sockets: the controller's ROUTER, a rank's DEALERs, the inproc pipes between
threads, one-off requests.

Every socket option of the control channel is set here and nowhere else (HWM, linger,
frame limit, reconnect back-off, CurveZMQ). The rank's I/O loop over its DEALER is
:mod:`mindft.rank.link`; the sockets of replication and of the step gate are :mod:`mindft.net.sockets`.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Iterable, Optional, Tuple, Union

import zmq

from mindft.net.keys import CurveKeys, secure_client, secure_server
from mindft.protocol import (MAX_FRAME, RELAY_SEPARATOR, DeviceEvent, InjectRequest, NodeLost, ProcessExit,
                             ProtocolError, Replaced, ReplicaReport, Reply, StatusReply, StatusRequest, decode, encode,
                             relay_cut)

log = logging.getLogger(__name__)

# ROUTER send queue per peer: a broadcast puts one frame in each peer's pipe, so a few
# thousand is plenty; beyond it ZeroMQ drops (a rank that far behind is declared dead anyway).
ROUTER_SEND_HWM = 10_000
ROUTER_RECEIVE_HWM = 100_000
# Pending TCP connections the controller's listening socket queues (the kernel caps it at
# net.core.somaxconn). Every rank connects at once when a job starts; with ZeroMQ's default
# of 100 the kernel drops the other SYNs and the ranks retry after 1, 3, 7 ... s (4000
# ranks on loopback: 31 s to connect instead of 1.5 s).
ROUTER_BACKLOG = 4096
# Keep unsent DUMP_AND_EXIT / FINISH frames this long after the controller closes.
ROUTER_LINGER_MS = 2_000
# Control traffic is a few frames per step; a deep queue only hides a dead peer.
DEALER_HWM = 1_000
DEALER_LINGER_MS = 1_000
REPORT_LINGER_MS = 200  # step reports still queued when a rank leaves: the last few are worth sending
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1_000
# How long a one-off request waits for its answer by default.
REQUEST_TIMEOUT = 5.0
# A request unanswered in time is given up: nothing of it is worth sending after close.
REQUEST_LINGER_MS = 0

Request = Union[StatusRequest, InjectRequest, ProcessExit, DeviceEvent, ReplicaReport, NodeLost]
_request_ids = itertools.count(1)
_pipe_ids = itertools.count()


# The two likely causes of a controller's silence, and their fixes: CurveZMQ drops a client with
# another key without a word, so a wrong key looks exactly like no controller.
UNREACHABLE_CAUSES = ("either no controller runs there: start the job with mindft-launch, node 0 included, or "
                      "unset MS_ENABLE_TFT to train without fault tolerance; or it holds a different key, and "
                      "CurveZMQ gives no answer to a wrong key: give every node the same --key-file")


class ControllerUnreachable(RuntimeError):
    """The controller did not answer a request in time."""


def normalize_address(address: str) -> str:
    """``host:port`` or ``tcp://host:port`` → ``tcp://host:port``; ValueError names what is valid."""
    text = address.strip()
    bare = text[len("tcp://"):] if text.startswith("tcp://") else text
    host, sep, port = bare.rpartition(":")
    if not sep or not host or "://" in bare or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"controller address {address!r} is not HOST:PORT or tcp://HOST:PORT "
                         f"(e.g. 127.0.0.1:29600)")
    return f"tcp://{host}:{int(port)}"


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint (an IPv6 address without its brackets)."""
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


def router(context: zmq.Context, keys: Optional[CurveKeys], address: str) -> zmq.Socket:
    """The controller's socket, bound to ``address`` (port ``*`` picks a free one)."""
    sock = context.socket(zmq.ROUTER)
    # A processor that reconnects with the same identity replaces its old connection.
    # ROUTER_MANDATORY stays off: a frame for a vanished peer is dropped; silence, not a
    # send error, decides that a peer is dead.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    sock.setsockopt(zmq.SNDHWM, ROUTER_SEND_HWM)
    sock.setsockopt(zmq.RCVHWM, ROUTER_RECEIVE_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)  # libzmq drops a peer that sends more, unread
    sock.setsockopt(zmq.LINGER, ROUTER_LINGER_MS)
    sock.setsockopt(zmq.BACKLOG, ROUTER_BACKLOG)
    secure_server(sock, keys)
    try:
        sock.bind(address)
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


class RouterSender:
    """Sends on the controller's ROUTER without ever blocking: a frame for a peer that is gone, or
    whose pipe is full, is dropped (silence, not a send error, decides that a peer is dead)."""

    # Broadcast frames from this size on share one buffer (below it, a copy per peer costs no more
    # than the shared message's reference counting: measured crossover ~2 kB).
    SHARE_FROM = 2048

    def __init__(self, sock: zmq.Socket) -> None:
        # zmq.Socket.send only adds draft-API arguments (routing_id, group) to the backend's
        # send: calling the backend's directly saves a Python call per frame, two frames per
        # rank per broadcast (16 384 ranks: ~15 ms per broadcast).
        self._send = super(zmq.Socket, sock).send
        # The last broadcast's peers and their routes: the job broadcasts each phase of a round to the
        # same peers (one tuple, kept while they do not change), so each route is worked out once.
        self._routes: tuple[Tuple[bytes, ...], list[tuple[bytes, ...]]] = ((), [])

    def to(self, peer: bytes, frame: bytes) -> None:
        self._to((_route(peer),), frame)

    def to_all(self, peers: Tuple[bytes, ...], frame: Union[bytes, zmq.Frame]) -> None:
        """The same bytes to every peer, encoded once. A large frame (the start barrier's
        RegisterAck carries every rank's endpoint) goes out as one zmq.Frame whose buffer every
        peer's message shares: sent as bytes, each peer gets its own copy (16 384 ranks: 2.9 GB
        and ~1 s of copying for one RegisterAck; shared: 180 kB, 30 ms). A peer behind a relay
        (``relay + RELAY_SEPARATOR + rank``; no rank: all of the relay's) is reached through the relay,
        its rank's identity in a frame of its own."""
        known, routes = self._routes
        if peers is not known:
            routes = [_route(peer) for peer in peers]
            self._routes = (peers, routes)
        self._to(routes, frame)

    def _to(self, routes: Iterable[tuple[bytes, ...]], frame: Union[bytes, zmq.Frame]) -> None:
        if len(frame) >= self.SHARE_FROM:
            frame = zmq.Frame(frame)
        send = self._send
        for route in routes:
            try:
                for part in route:
                    send(part, _MORE_NOBLOCK)
                send(frame, _NOBLOCK)
            except zmq.ZMQError as error:
                log.debug("could not send to %r: %s", RELAY_SEPARATOR.join(route), error)


def _route(peer: bytes) -> tuple[bytes, ...]:
    """The frames that address ``peer`` on the ROUTER: its identity, or a relay's and the rank's behind it."""
    cut = relay_cut(peer)
    return (peer,) if cut < 0 else (peer[:cut], peer[cut + 1:])


_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)


def dealer(context: zmq.Context, keys: Optional[CurveKeys], address: str, identity: bytes = b"") -> zmq.Socket:
    """A rank's (or a client's) socket connected to the controller at ``address``."""
    sock = context.socket(zmq.DEALER)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, DEALER_LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, DEALER_HWM)
    sock.setsockopt(zmq.RCVHWM, DEALER_HWM)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    # IMMEDIATE stays off on purpose: frames queue until the TCP connection exists, so a
    # rank started before its controller registers as soon as the controller binds.
    secure_client(sock, keys)
    sock.connect(address)
    return sock


def report_dealer(context: zmq.Context, keys: Optional[CurveKeys], address: str, identity: bytes) -> zmq.Socket:
    """A rank's second DEALER, for the training thread's fire-and-forget step reports."""
    sock = dealer(context, keys, address, identity)
    sock.setsockopt(zmq.LINGER, REPORT_LINGER_MS)
    return sock


def pipe(context: zmq.Context, name: str) -> Tuple[zmq.Socket, zmq.Socket]:
    """An inproc PAIR pipe (reading end, writing end) between two threads of this process (a rank's
    frames to its I/O thread, the controller's wake-ups); both ends drop what is queued at close."""
    address = f"inproc://mindft-{name}-{os.getpid()}-{next(_pipe_ids)}"
    ends = []
    for connect in (False, True):
        sock = context.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        (sock.connect if connect else sock.bind)(address)
        ends.append(sock)
    return ends[0], ends[1]


def request(address: str, keys: Optional[CurveKeys], message: Request, timeout: float = REQUEST_TIMEOUT,
            context: Optional[zmq.Context] = None) -> Union[Reply, StatusReply, Replaced]:
    """Send one request and return the reply carrying its ``request_id``.

    A fresh socket per request (the guide's Lazy Pirate), and replies are matched by id, so a
    late answer to an earlier request is never taken for this one.
    Raises :class:`ControllerUnreachable` when nothing matching arrives within ``timeout``.
    """
    request_id = (os.getpid() << 20) + next(_request_ids)
    message = type(message)(**{**message.__dict__, "request_id": request_id})
    own = context is None
    context = zmq.Context() if own else context
    sock = dealer(context, keys, normalize_address(address))
    try:
        sock.setsockopt(zmq.LINGER, REQUEST_LINGER_MS)
        sock.send(encode(message))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(left * 1000.0):
                raise ControllerUnreachable(f"no answer from the controller at {address} within {timeout:g} s: "
                                            f"is the job running, and is this the job's key? (CurveZMQ gives "
                                            f"no answer to a different key)")
            try:
                reply = decode(sock.recv())
            except ProtocolError as error:
                log.debug("ignoring a bad frame from the controller: %s", error)
                continue
            if isinstance(reply, (Reply, StatusReply, Replaced)) and reply.request_id == request_id:
                return reply
    finally:
        sock.close(0)
        if own:
            context.term()


class Client:
    """One-off requests to the controller at ``address`` (launcher, CLI, demo)."""

    def __init__(self, address: str, keys: Optional[CurveKeys], timeout: float = REQUEST_TIMEOUT) -> None:
        self.address = address  # checked when used: the launcher may not know its port yet
        self.keys = keys
        self.timeout = timeout

    def request(self, message: Request) -> Union[Reply, StatusReply, Replaced]:
        """Send ``message``; the reply with its request id, or :class:`ControllerUnreachable`."""
        return request(self.address, self.keys, message, self.timeout)

    def status(self) -> StatusReply:
        """The controller's current view of the job."""
        reply = self.request(StatusRequest())
        if not isinstance(reply, StatusReply):
            raise ControllerUnreachable(f"unexpected answer to a status request: {type(reply).__name__}")
        return reply
