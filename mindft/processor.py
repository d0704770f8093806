"""The per-rank side of the control channel: one ZeroMQ DEALER owned by one I/O thread.

The training thread calls :class:`Processor`'s methods; they hand frames to the I/O
thread through an inproc pipe and wait on a condition for what it receives. The I/O
thread heartbeats the controller and, Paranoid-Pirate style, treats a controller that
stayed silent for ``timeouts.dead_after`` as unreachable: it closes the socket, opens a
fresh one (same identity), re-sends the registration, and gives up after
``timeouts.connect_retries`` silent periods in a row (cf. MindIO's TTP_RETRY_TIMES).
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from typing import Iterable, Optional, Union

import zmq

from mindft.config import MindftConfig
from mindft.keys import CurveKeys, job_keys, secure_client
from mindft.protocol import (MAX_FRAME, Ack, Action, ActionKind, Done, FaultKind, FaultReport,
                             Heartbeat, Message, ProtocolError, Register, RegisterAck, StepPhase,
                             StepReport, decode, encode)

log = logging.getLogger(__name__)

# Unsent frames (a final Done or Ack) are kept this long when the processor closes.
CLOSE_LINGER_MS = 1_000
# Control traffic is a few frames per step; a deep queue only hides a dead peer.
SOCKET_HWM = 1_000
# libzmq's own TCP reconnect back-off while a connection is down.
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 1_000
# Tags of the frames on the inproc pipe from the training thread to the I/O thread.
_MESSAGE, _REGISTER, _STOP = b"M", b"R", b"S"
_pipe_ids = itertools.count()


class ProcessorError(RuntimeError):
    """The controller is unreachable, or the processor was used after close()."""


class Processor:
    """One rank's connection to the controller (see the module docstring).

    ``replica_endpoint`` is this rank's replica server, published to the other ranks.
    The incarnation defaults to ``config.restart_count`` (set by mindft-launch); the
    socket identity is ``rank<R>.inc<I>``, so a restarted rank is a new peer.
    """

    def __init__(self, config: MindftConfig, replica_endpoint: str = "", *,
                 incarnation: Optional[int] = None, context: Optional[zmq.Context] = None,
                 keys: Optional[CurveKeys] = None) -> None:
        self.rank = config.rank
        self.incarnation = config.restart_count if incarnation is None else incarnation
        self.replica_endpoint = replica_endpoint
        self._config = config
        self._timeouts = config.timeouts
        self._keys = keys if keys is not None else job_keys(config)
        self._own_context = context is None
        self._context = zmq.Context() if context is None else context
        self.identity = f"rank{self.rank}.inc{self.incarnation}".encode()
        self._cond = threading.Condition()
        self._actions: collections.deque[Action] = collections.deque()
        self._committed = -1
        self._round = 0
        self._ack: Optional[RegisterAck] = None
        self._endpoints: dict[int, str] = {}
        self._error: Optional[str] = None
        self._closed = False
        self._step = -1
        self._send_lock = threading.Lock()
        address = f"inproc://mindft-processor-{os.getpid()}-{next(_pipe_ids)}"
        self._pipe_in = self._context.socket(zmq.PAIR)
        self._pipe_in.setsockopt(zmq.LINGER, 0)
        self._pipe_in.bind(address)
        self._pipe_out = self._context.socket(zmq.PAIR)
        self._pipe_out.setsockopt(zmq.LINGER, 0)
        self._pipe_out.connect(address)
        self._thread = threading.Thread(target=self._run, name=f"mindft-processor-{self.rank}", daemon=True)
        self._thread.start()

    @property
    def endpoints(self) -> dict[int, str]:
        """The latest rank → replica endpoint map (RegisterAck, updated by ROLLBACK/RESUME)."""
        with self._cond:
            return dict(self._endpoints)

    @property
    def committed_step(self) -> int:
        """The last COMMIT received (reset to the repair step by ROLLBACK/RESUME)."""
        with self._cond:
            return self._committed

    def register(self, held_steps: Iterable[int] = ()) -> RegisterAck:
        """Join the job and wait at the start barrier (or get an immediate ack after a restart).

        Raises :class:`ProcessorError` if the controller does not answer within
        ``timeouts.register``, stays unreachable for ``connect_retries`` silent periods, or
        fails the job meanwhile (its DUMP_AND_EXIT stays queued for :meth:`wait_action`).
        """
        with self._cond:
            self._ack = None
        self._send(Register(self.rank, self.incarnation, os.getpid(), tuple(sorted(held_steps)),
                            self.replica_endpoint), tag=_REGISTER)
        deadline = time.monotonic() + self._timeouts.register + self._timeouts.dead_after
        with self._cond:
            while self._ack is None:
                self._raise_if_broken()
                failed = next((a for a in self._actions if a.kind is ActionKind.DUMP_AND_EXIT), None)
                if failed is not None:  # left queued: wait_action() still returns it
                    raise ProcessorError(f"rank {self.rank}: the controller ended the job before "
                                         f"registration completed: {failed.reason}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProcessorError(f"rank {self.rank}: no RegisterAck from "
                                         f"{self._config.controller_address} within "
                                         f"{self._timeouts.register:g} s (timeouts.register)")
                self._cond.wait(left)
            log.info("rank=%d incarnation=%d registered; controller state %s, %d endpoints", self.rank,
                     self.incarnation, self._ack.state, len(self._ack.endpoints))
            return self._ack

    def step_begin(self, step: int) -> None:
        """Report that the optimizer update of ``step`` starts."""
        self._step = step
        self._send(StepReport(self.rank, step, StepPhase.STARTED))

    def step_end(self, step: int, timeout: Optional[float] = None) -> Optional[Action]:
        """Vote FINISHED(step) and block until COMMIT(step) (→ None) or another action (→ it).

        ``timeout`` (None: wait as long as the controller is alive) raises TimeoutError.
        """
        self._step = step
        self._send(StepReport(self.rank, step, StepPhase.FINISHED))
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._actions:
                    return self._actions.popleft()
                if self._committed >= step:
                    return None
                self._raise_if_broken()
                self._wait(deadline, f"COMMIT({step})")

    def report_fault(self, kind: FaultKind, detail: str = "", step: Optional[int] = None) -> None:
        """Tell the controller this rank hit ``kind`` inside ``step`` (default: the current step)."""
        self._send(FaultReport(self.rank, self._step if step is None else step, FaultKind(kind), detail))

    def poll_action(self) -> Optional[Action]:
        """The next pending action (never COMMIT), or None; does not block."""
        with self._cond:
            if self._actions:
                return self._actions.popleft()
            self._raise_if_broken()
            return None

    def wait_action(self, timeout: Optional[float] = None) -> Action:
        """Block until the next action (never COMMIT); TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._actions:
                self._raise_if_broken()
                self._wait(deadline, "an action")
            return self._actions.popleft()

    def acknowledge(self, action: Union[Action, ActionKind], step: int, held_steps: Iterable[int] = ()) -> None:
        """Acknowledge ``action`` (PAUSED / RESTORED / RESUMED) at ``step``, holding ``held_steps``.

        Pass the Action itself so the acknowledgement carries its recovery round.
        """
        if isinstance(action, Action):
            kind, round_ = action.kind, action.round
        else:
            kind, round_ = ActionKind(action), self._round
        self._send(Ack(self.rank, kind, step, tuple(sorted(held_steps)), round_))

    def done(self, step: int) -> None:
        """Report that training finished at ``step``."""
        self._send(Done(self.rank, step))

    def close(self) -> None:
        """Flush pending frames (up to CLOSE_LINGER_MS), stop the I/O thread, free the sockets."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        with self._send_lock:
            try:
                self._pipe_out.send_multipart([_STOP, b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._thread.join(CLOSE_LINGER_MS / 1000 + 2.0)
        with self._send_lock:
            self._pipe_out.close(0)
        if self._own_context:
            if self._thread.is_alive():
                self._context.destroy(0)
            else:
                self._context.term()

    def __enter__(self) -> "Processor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_if_broken(self) -> None:
        if self._closed:
            raise ProcessorError(f"rank {self.rank}: processor is closed")
        if self._error is not None:
            raise ProcessorError(self._error)

    def _wait(self, deadline: Optional[float], what: str) -> None:
        if deadline is None:
            self._cond.wait()
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"rank {self.rank}: no {what} from the controller in time")
        self._cond.wait(left)

    def _send(self, message: Message, tag: bytes = _MESSAGE) -> None:
        frame = encode(message)
        with self._send_lock:
            self._raise_if_broken()
            try:
                self._pipe_out.send_multipart([tag, frame], zmq.NOBLOCK)
            except zmq.ZMQError as error:
                raise ProcessorError(f"rank {self.rank}: I/O thread is not accepting frames ({error})") from None

    def _open(self) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, SOCKET_HWM)
        sock.setsockopt(zmq.RCVHWM, SOCKET_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        # IMMEDIATE stays off on purpose: frames queue until the TCP connection exists, so a
        # rank started before its controller registers as soon as the controller binds.
        secure_client(sock, self._keys)
        sock.connect(self._config.controller_address)
        return sock

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as error:  # the training thread must learn about it, not hang
            log.exception("rank=%d processor I/O thread failed", self.rank)
            with self._cond:
                self._error = f"rank {self.rank}: processor I/O thread failed: {error}"
                self._cond.notify_all()
        finally:
            self._pipe_in.close(0)

    def _loop(self) -> None:
        interval = self._timeouts.heartbeat_interval
        dead_after = self._timeouts.dead_after
        retries = self._timeouts.connect_retries
        sock = self._open()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._pipe_in, zmq.POLLIN)
        register_frame: Optional[bytes] = None  # re-sent after every reconnect
        last_heard = next_beat = time.monotonic()
        silent_periods = 0
        try:
            while True:
                now = time.monotonic()
                timeout = interval if register_frame is None else \
                    max(0.0, min(next_beat, last_heard + dead_after) - now)
                ready = dict(poller.poll(timeout * 1000.0))
                if self._pipe_in in ready:
                    while True:
                        try:
                            tag, frame = self._pipe_in.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if tag == _STOP:
                            return
                        if tag == _REGISTER:
                            register_frame = frame
                            last_heard = time.monotonic()
                        try:
                            sock.send(frame, zmq.NOBLOCK)
                        except zmq.Again:
                            # SOCKET_HWM frames queued: the controller has been gone for long;
                            # the silence check below reconnects (and re-registers).
                            log.warning("rank=%d send queue full; frame dropped", self.rank)
                if sock in ready:
                    silent_periods = 0
                    last_heard = time.monotonic()
                    self._receive_all(sock)
                if register_frame is None:
                    continue  # not part of a job yet: nothing to heartbeat or time out
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + interval
                    try:
                        sock.send(encode(Heartbeat(self.rank, self.incarnation, self._step)), zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # queue full while disconnected: the silence check handles it
                if now - last_heard > dead_after:
                    silent_periods += 1
                    if silent_periods >= retries:
                        with self._cond:
                            self._error = (f"rank {self.rank}: controller at "
                                           f"{self._config.controller_address} silent for {retries} "
                                           f"periods of {dead_after:g} s (timeouts.connect_retries); "
                                           f"is it running, and do both sides use the same key?")
                            self._cond.notify_all()
                        log.error("%s", self._error)
                        return
                    log.warning("rank=%d controller silent for %.2f s; reconnecting (attempt %d of %d)",
                                self.rank, now - last_heard, silent_periods + 1, retries)
                    poller.unregister(sock)
                    sock.close(0)
                    sock = self._open()
                    poller.register(sock, zmq.POLLIN)
                    sock.send(register_frame, zmq.NOBLOCK)
                    last_heard = now
        finally:
            sock.close(CLOSE_LINGER_MS)

    def _receive_all(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode(frame)
            except ProtocolError as error:
                log.warning("rank=%d dropped a frame from the controller: %s", self.rank, error)
                continue
            if isinstance(message, Heartbeat):
                continue
            with self._cond:
                if isinstance(message, Action):
                    self._on_action(message)
                elif isinstance(message, RegisterAck):
                    self._endpoints = dict(message.endpoints)
                    self._ack = message
                else:
                    log.warning("rank=%d ignored unexpected %s", self.rank, type(message).__name__)
                    continue
                self._cond.notify_all()

    def _on_action(self, action: Action) -> None:
        self._endpoints.update(action.endpoints)
        self._round = max(self._round, action.round)
        if action.kind is ActionKind.COMMIT:
            self._committed = max(self._committed, action.step)
            return
        if action.kind in (ActionKind.ROLLBACK, ActionKind.RESUME):
            # The next COMMIT the rank waits for is for a replayed step after action.step.
            self._committed = action.step
        log.info("rank=%d received %s step=%d round=%d", self.rank, action.kind.name, action.step, action.round)
        self._actions.append(action)


def request(config: MindftConfig, message: Message, timeout: float = 5.0,
            keys: Optional[CurveKeys] = None) -> Message:
    """Send one message to the controller and return its answer (for the CLI and launcher).

    For StatusRequest, InjectRequest, ProcessExit and DeviceEvent. Raises ProcessorError
    if nothing comes back within ``timeout`` seconds.
    """
    keys = keys if keys is not None else job_keys(config)
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        secure_client(sock, keys)
        sock.connect(config.controller_address)
        sock.send(encode(message))
        if not sock.poll(timeout * 1000.0):
            raise ProcessorError(f"no answer from the controller at {config.controller_address} "
                                 f"within {timeout:g} s")
        try:
            return decode(sock.recv())
        except ProtocolError as error:
            raise ProcessorError(f"bad answer from the controller: {error}") from None
    finally:
        context.destroy(0)
