"""A rank's link to the controller: the I/O thread's loop over the rank's DEALER.

The training thread (:class:`mindft.rank.processor.Processor`) hands frames to this loop through an
inproc pipe (:func:`mindft.net.channel.pipe`), each behind a one-byte ``PIPE_*`` tag; the loop sends
them, reads what the controller sends, and carries out :class:`mindft.flow.liveness.Liveness`'s
decisions: a heartbeat when one is due, a new connection when the controller is silent, giving up.
The socket and its options are :mod:`mindft.net.channel`'s.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Optional

import zmq

from mindft.config import MindftConfig
from mindft.flow.liveness import Liveness, Verdict
from mindft.flow.standby import rank_retries
from mindft.net.channel import DEALER_LINGER_MS, UNREACHABLE_CAUSES, dealer
from mindft.net.keys import CurveKeys
from mindft.protocol import Message, ProtocolError, decode

log = logging.getLogger(__name__)

# One-byte tags in front of each frame on a rank's inproc pipe to its I/O thread (run_link).
PIPE_MESSAGE, PIPE_REGISTER, PIPE_STOP = b"M", b"R", b"S"


def receive_all(sock: zmq.Socket, who: str) -> Iterator[Message]:
    """Every message waiting on ``sock``, decoded; a bad frame is logged and dropped."""
    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            yield decode(frame)
        except ProtocolError as error:
            log.warning("%s dropped a frame from the controller: %s", who, error)


def run_link(context: zmq.Context, keys: Optional[CurveKeys], config: MindftConfig, identity: bytes,
             pipe_in: zmq.Socket, heartbeat: Callable[[], bytes], reported_at: Callable[[], float],
             receive: Callable[[zmq.Socket], None], register_again: Callable[[], bytes]) -> Optional[str]:
    """A rank's DEALER on its I/O thread, until told to stop (None) or it gives up (the reason).

    Frames tagged PIPE_* arrive on ``pipe_in`` and go out; ``receive(sock)`` reads what the
    controller sends. Once registered, :class:`~mindft.flow.liveness.Liveness` decides when a
    ``heartbeat()`` frame is due (``reported_at()``: the newest step report sent on the training
    thread's own socket) and what a silent controller means: reconnect (same identity) and
    re-register with ``register_again()`` (the registration as it stands now: a controller started
    again learns how far the rank got), or give up.
    """
    timeouts, monotonic, rank, address = config.timeouts, time.monotonic, config.rank, config.control_address
    # What a rank that hears nothing names: the controller, and the relay its traffic goes through.
    controller = config.controller_address + (f" (through this node's relay at {config.relay})" if config.relay else "")
    # A rank started by hand (not by mindft-launch) has nobody to wait for: one silent period.
    retries = rank_retries(timeouts.connect_retries, config.standbys)
    live = Liveness(timeouts.heartbeat_interval, timeouts.dead_after, retries, retries if config.launcher_pid else 1,
                    monotonic())
    sock = dealer(context, keys, address, identity)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(pipe_in, zmq.POLLIN)
    registered = False  # the registration went out: from now on the controller's silence counts
    try:
        while True:
            # Not part of a job yet: nothing to heartbeat or time out.
            timeout = live.timeout(monotonic(), reported_at()) if registered else live.interval
            ready = dict(poller.poll(timeout * 1000.0))
            if pipe_in in ready:
                while True:
                    try:
                        data = pipe_in.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    tag, frame = data[:1], data[1:]
                    if tag == PIPE_STOP:
                        return None
                    if tag == PIPE_REGISTER:
                        registered = True
                        live.registering(monotonic())
                    try:
                        sock.send(frame, zmq.NOBLOCK)
                        live.sent(monotonic())
                    except zmq.Again:  # the silence check reconnects and re-registers
                        log.warning("rank=%d send queue full; frame dropped", rank)
            if sock in ready:
                live.received(monotonic())
                receive(sock)
            if not registered:
                continue
            check = live.check(monotonic(), reported_at())
            if check.beat:
                try:
                    sock.send(heartbeat(), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            if check.verdict is Verdict.NEVER_ANSWERED:
                return (f"rank {rank}: no mindft controller answers at {controller} (waited "
                        f"{check.periods * live.dead_after:g} s): {UNREACHABLE_CAUSES}")
            if check.verdict is Verdict.SILENT:
                return (f"rank {rank}: controller at {controller} silent for {live.retries} periods of "
                        f"{live.dead_after:g} s (timeouts.connect_retries); is it running, and do both sides "
                        f"use the same key?")
            if check.verdict is Verdict.RECONNECT:
                log.log(logging.WARNING if live.heard else logging.DEBUG,
                        "rank=%d controller silent for %.2f s; reconnecting (attempt %d of %d)",
                        rank, check.silent_for, check.periods + 1, live.retries)
                poller.unregister(sock)
                sock.close(0)
                sock = dealer(context, keys, address, identity)
                poller.register(sock, zmq.POLLIN)
                sock.send(register_again(), zmq.NOBLOCK)
    finally:
        sock.close(DEALER_LINGER_MS)
