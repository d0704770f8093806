"""The sockets beside the control channel: replication's (the keeper, the sender, one-off requests)
and MindIO's step gate.

Every option of these sockets is set here and nowhere else (HWM, linger, send timeout), and each
server and client is made CurveZMQ's with :mod:`mindft.net.keys`. Their users keep the rest: the
context (and its ZAP handler), what is sent and when. The control channel's sockets are in
:mod:`mindft.net.channel`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import zmq

from mindft.net.keys import CurveKeys, bind_server, secure_client

# Replication moves a rank's state in parts of at most a chunk (mindft.replica.wire.CHUNK): a few
# messages queued per direction bound what a slow or dead keeper costs the sender to a few chunks,
# never a whole state.
REPLICA_HWM = 4
# A push cut short is sent again whole, so parts still queued at close are not worth waiting for.
REPLICA_LINGER_MS = 0
# A one-off request (a push in one message, a fetch) is one message each way: no queue limit.
REPLICA_REQUEST_HWM = 0
# The step gate: one small request in flight per rank, answered within GATE_HOLD_SECONDS; a rank that
# hears nothing drops its socket and asks again on a new one. ZeroMQ's default queue, stated.
GATE_HWM = 1_000
GATE_LINGER_MS = 0


def _options(sock: zmq.Socket, linger_ms: int, hwm: int) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


def _bound(sock: zmq.Socket, keys: Optional[CurveKeys], ip: str, port: int) -> Tuple[zmq.Socket, str]:
    try:
        return sock, bind_server(sock, keys, ip, port)
    except zmq.ZMQError:
        sock.close(0)
        raise


def _connected(sock: zmq.Socket, keys: Optional[CurveKeys], endpoint: str) -> zmq.Socket:
    secure_client(sock, keys)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


def keeper_router(context: zmq.Context, keys: Optional[CurveKeys], ip: str, port: int = 0) -> Tuple[zmq.Socket, str]:
    """A replica keeper's ROUTER bound on ``ip`` and ``port`` (0: a free one), and its endpoint."""
    # Messages are at most a chunk (a one-request push is the state: counted as one).
    return _bound(_options(context.socket(zmq.ROUTER), REPLICA_LINGER_MS, REPLICA_HWM), keys, ip, port)


def keeper_dealer(context: zmq.Context, keys: Optional[CurveKeys], endpoint: str) -> zmq.Socket:
    """A sender's long-lived DEALER connected to the keeper at ``endpoint``."""
    return _connected(_options(context.socket(zmq.DEALER), REPLICA_LINGER_MS, REPLICA_HWM), keys, endpoint)


def keeper_request_dealer(keys: Optional[CurveKeys], endpoint: str, timeout: float,
                          context: Optional[zmq.Context] = None) -> zmq.Socket:
    """A DEALER for one request to the keeper at ``endpoint`` (a socket of its own, on the process's
    shared context unless ``context`` is given); a send waits at most ``timeout`` seconds."""
    sock = _options((context or zmq.Context.instance()).socket(zmq.DEALER), REPLICA_LINGER_MS, REPLICA_REQUEST_HWM)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    return _connected(sock, keys, endpoint)


def gate_router(context: zmq.Context, keys: Optional[CurveKeys], ip: str, port: int = 0) -> Tuple[zmq.Socket, str]:
    """The step gate's ROUTER bound on ``ip`` and ``port`` (0: a free one), and its endpoint."""
    return _bound(_options(context.socket(zmq.ROUTER), GATE_LINGER_MS, GATE_HWM), keys, ip, port)


def gate_dealer(context: zmq.Context, keys: Optional[CurveKeys], endpoint: str) -> zmq.Socket:
    """A rank's DEALER connected to the step gate at ``endpoint``."""
    return _connected(_options(context.socket(zmq.DEALER), GATE_LINGER_MS, GATE_HWM), keys, endpoint)
