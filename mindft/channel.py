"""The control channel's sockets: the controller's ROUTER, a rank's DEALER, one-off requests.

Every socket option of the control channel is set here and nowhere else (HWM, linger,
frame limit, reconnect back-off, CurveZMQ).
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Optional, Union

import zmq

from mindft.keys import CurveKeys, secure_client, secure_server
from mindft.protocol import (MAX_FRAME, DeviceEvent, InjectRequest, NodeLost, ProcessExit, ProtocolError, ReplicaReport,
                             Reply, StatusReply, StatusRequest, decode, encode)

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

Request = Union[StatusRequest, InjectRequest, ProcessExit, DeviceEvent, ReplicaReport, NodeLost]
_request_ids = itertools.count(1)


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


def request(address: str, keys: Optional[CurveKeys], message: Request, timeout: float = REQUEST_TIMEOUT,
            context: Optional[zmq.Context] = None) -> Union[Reply, StatusReply]:
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
        sock.setsockopt(zmq.LINGER, 0)
        sock.send(encode(message))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(left * 1000.0):
                raise ControllerUnreachable(f"no answer from the controller at {address} within {timeout:g} s "
                                            f"(is the job running, and is this the job's key?)")
            try:
                reply = decode(sock.recv())
            except ProtocolError as error:
                log.debug("ignoring a bad frame from the controller: %s", error)
                continue
            if isinstance(reply, (Reply, StatusReply)) and reply.request_id == request_id:
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

    def request(self, message: Request) -> Union[Reply, StatusReply]:
        """Send ``message``; the reply with its request id, or :class:`ControllerUnreachable`."""
        return request(self.address, self.keys, message, self.timeout)

    def status(self) -> StatusReply:
        """The controller's current view of the job."""
        reply = self.request(StatusRequest())
        if not isinstance(reply, StatusReply):
            raise ControllerUnreachable(f"unexpected answer to a status request: {type(reply).__name__}")
        return reply
