"""The node agent's relay: its ranks' control traffic to and from the controller, on a thread of its own.

The ranks connect to the relay's ROUTER on this host (``ipc://``, CurveZMQ like every mindft link);
the relay holds one DEALER to the controller (identity ``relay/<node>/<pid>``) and speaks the relay
protocol on it (:mod:`mindft.protocol`, version 15). What goes up, and when, is
:class:`mindft.flow.relay.Relay`'s decision; this shell moves frames and passes the time.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Union

import zmq

from mindft.config import Timeouts
from mindft.flow.relay import Down, Relay, Up
from mindft.net import channel
from mindft.net.keys import CurveKeys
from mindft.protocol import ProtocolError, decode, encode

log = logging.getLogger(__name__)

# How long a phase's acks wait at the relay for its last rank before they go up without it.
LINGER = 0.05
_NOBLOCK = int(zmq.NOBLOCK)
_FOLLOW, _STOP = b"f", b"s"


class RelayShell:
    """The relay of node ``node``'s ranks (see the module docstring); :attr:`endpoint` is where its ranks
    connect (``MINDFT_RELAY``), a socket file in ``directory`` (the agent's memory, which goes with it;
    None: the temporary directory)."""

    def __init__(self, node: int, controller_address: str, keys: Optional[CurveKeys], timeouts: Timeouts,
                 directory: Optional[Path] = None) -> None:
        self._context = zmq.Context()
        self._keys, self._timeouts = keys, timeouts
        self._identity = f"relay/{node}/{os.getpid()}".encode()
        self._path = str(directory / "relay.ipc") if directory is not None else \
            os.path.join(tempfile.gettempdir(), f"mindft-relay-{node}-{os.getpid()}.ipc")
        self.endpoint = f"ipc://{self._path}"
        self._ranks = channel.router(self._context, keys, self.endpoint)
        self._address = controller_address
        self._wake_in, self._wake_out = channel.pipe(self._context, "relay")
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"mindft-relay-{node}", daemon=True)
        self._thread.start()
        log.info("node %d relays its ranks' control traffic at %s to the controller at %s", node, self.endpoint,
                 controller_address)

    def follow(self, controller_address: str) -> None:
        """The job's controller is at ``controller_address`` now (a standby took command, it moved)."""
        self._address = controller_address
        self._wake(_FOLLOW)

    def close(self) -> None:
        """Stop the thread, close the sockets, remove the socket file."""
        self._wake(_STOP)
        self._thread.join(5.0)
        with self._wake_lock:
            self._wake_out.close(0)
            self._wake_out = None
        if self._thread.is_alive():
            self._context.destroy(0)
        else:
            self._context.term()
        try:
            os.unlink(self._path)
        except OSError:
            pass

    def _wake(self, what: bytes) -> None:
        with self._wake_lock:
            if self._wake_out is not None:
                self._wake_out.send(what)

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # the ranks find out: their controller falls silent, and they give up as they would
            log.exception("the relay thread failed")
        finally:
            self._ranks.close(0)
            self._wake_in.close(0)

    def _serve(self) -> None:
        monotonic = time.monotonic
        timeouts = self._timeouts
        relay = Relay(LINGER, timeouts.heartbeat_interval, 2 * timeouts.heartbeat_interval, monotonic())
        ranks = self._ranks
        up = channel.dealer(self._context, self._keys, self._address, self._identity)
        poller = zmq.Poller()
        for sock in (ranks, up, self._wake_in):
            poller.register(sock, zmq.POLLIN)

        def carry(effects: list[Union[Up, Down]], frame: bytes = b"") -> None:
            for effect in effects:
                try:
                    if type(effect) is Down:
                        ranks.send_multipart([effect.identity, encode(effect.message)], _NOBLOCK)
                    elif effect.identity:  # a rank's own message: the frame it sent, unchanged
                        up.send_multipart([effect.identity, frame or encode(effect.message)], _NOBLOCK)
                    else:
                        up.send(encode(effect.message), _NOBLOCK)
                except zmq.ZMQError as error:  # a full queue: silence, not an error, tells the other side
                    log.debug("relay dropped a %s: %s", type(effect.message).__name__, error)

        try:
            while True:
                wait = max(0.0, min(relay.next_wakeup() - monotonic(), timeouts.heartbeat_interval))
                ready = dict(poller.poll(wait * 1000.0))
                now = monotonic()
                if self._wake_in in ready:
                    command = self._wake_in.recv()
                    if command == _STOP:
                        return
                    poller.unregister(up)
                    up.close(0)
                    up = channel.dealer(self._context, self._keys, self._address, self._identity)
                    poller.register(up, zmq.POLLIN)
                    relay.new_controller()
                while ranks in ready:
                    try:
                        identity, frame = ranks.recv_multipart(_NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:  # not [identity, frame]
                        continue
                    try:
                        message = decode(frame)
                    except ProtocolError as error:
                        log.warning("relay dropped a frame from %r: %s", identity[:32], error)
                        continue
                    carry(relay.from_rank(identity, message, now), frame)
                while up in ready:
                    try:
                        parts = up.recv_multipart(_NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        message = decode(parts[-1])
                    except ProtocolError as error:
                        log.warning("relay dropped a frame from the controller: %s", error)
                        continue
                    relay.from_controller(message, now)
                    if len(parts) != 2:
                        continue  # the relay's own (a heartbeat's answer)
                    to, frame = parts
                    for identity in (relay.ranks.values() if not to else (to,)):
                        try:
                            ranks.send_multipart([identity, frame], _NOBLOCK)
                        except zmq.ZMQError:
                            pass
                carry(relay.tick(now))
        finally:
            up.close(channel.DEALER_LINGER_MS)

