"""One rank's end of the control channel: the ZeroMQ shell around :class:`mindft.flow.Follower`.

The training thread calls :class:`Processor`; one I/O thread owns the DEALER socket. Frames go
to it through an inproc pipe; actions and progress come back under a condition. When to send
a heartbeat, reconnect or give up on a silent controller is :class:`mindft.flow.liveness.Liveness`'s
decision; which step report may go now is the follower's. The rank's driver loop over this
shell is :class:`mindft.rank.loop.RankLoop`.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Optional, Sequence

import zmq

from mindft.net import channel
from mindft.rank import link
from mindft.config import MindftConfig
from mindft.flow.cadence import Schedule, ScheduleError
from mindft.flow.follower import Follower
from mindft.net.keys import CurveKeys, job_keys
from mindft.protocol import (REPORT_SUFFIX, Action, ActionKind, Cadence, CostReport, Done, FaultKind, FaultReport,
                             Heartbeat, Message, Pace, Progress, Register, RegisterAck, ReplicaReport, Reply, encode,
                             encode_heartbeat, encode_step_report)

log = logging.getLogger(__name__)

_MESSAGE, _REGISTER, _STOP = link.PIPE_MESSAGE, link.PIPE_REGISTER, link.PIPE_STOP


class ProcessorError(RuntimeError):
    """The controller is unreachable, or the processor was used after close()."""


class Processor:
    """One rank's connection to the controller (see the module docstring).

    The incarnation defaults to ``config.restart_count`` (set by mindft-launch); the socket
    identity is ``rank<R>.inc<I>``, so a restarted rank is a new peer. The snapshot cadence is
    the job's (RegisterAck, Cadence) unless fixed by ``snapshot_every`` or MINDFT_SNAPSHOT_EVERY
    (the same on every rank); :attr:`reports_costs` says whether the job wants :meth:`report_cost`.
    :attr:`report_limit` (when set) caps the step a report may claim (``Follower.report``): a rank
    replicating its own snapshots reports a capture step once its replica arrived, and calls
    :meth:`release_reports` (any thread; :attr:`report_lock` guards the follower) when it rises.
    """

    def __init__(self, config: MindftConfig, replica_endpoint: str = "", *, incarnation: Optional[int] = None,
                 keys: Optional[CurveKeys] = None, snapshot_every: Optional[int] = None) -> None:
        self.rank = config.rank
        self.incarnation = config.restart_count if incarnation is None else incarnation
        # None of its own: the node agent's keeper holds this node's replicas (mindft-launch sets it).
        self.replica_endpoint = replica_endpoint or config.replica_endpoint
        self.follower = Follower(self.rank, snapshot_every or config.snapshot_every or 1)
        self._own_cadence = snapshot_every is not None or config.snapshot_every is not None
        self.reports_costs = not self._own_cadence
        self._report_socket: Optional[zmq.Socket] = None  # the training thread's, for step reports
        self._reported_at = 0.0  # monotonic time of the last step report sent (read by the I/O thread)
        self.report_limit: Optional[Callable[[int], int]] = None  # step finished → the newest step to report
        self.report_lock = threading.Lock()
        self._config = config
        self._timeouts = config.timeouts
        self._keys = keys if keys is not None else job_keys(config)
        self._context = zmq.Context()
        self.identity = f"rank{self.rank}.inc{self.incarnation}".encode()
        self._cond = threading.Condition()
        self._actions: collections.deque[Action] = collections.deque()
        self._ack: Optional[RegisterAck] = None
        self._registration: Optional[Register] = None
        self._endpoints: dict[int, str] = {}
        self._error: Optional[str] = None
        self._closed = False
        self._send_lock = threading.Lock()
        self._pipe_in, self._pipe_out = channel.pipe(self._context, "processor")
        self._thread = threading.Thread(target=self._run, name=f"mindft-processor-{self.rank}", daemon=True)
        self._thread.start()

    @property
    def endpoints(self) -> dict[int, str]:
        """The latest rank → replica endpoint map (RegisterAck, updated by ROLLBACK/RESUME)."""
        with self._cond:
            return dict(self._endpoints)

    def endpoint_of(self, rank: int) -> Optional[str]:
        """Where ``rank`` keeps replicas, from the latest map (None: not known)."""
        with self._cond:
            return self._endpoints.get(rank) or None

    def register(self, held_steps: Sequence[int] = (), collectives: bool = False) -> RegisterAck:
        """Join the job and wait at the start barrier (or get an immediate ack after a restart).

        Raises :class:`ProcessorError` if the controller does not answer within
        ``timeouts.register``, stays unreachable, or ends the job meanwhile.
        """
        self._registration = Register(self.rank, self.incarnation, os.getpid(), tuple(sorted(held_steps)),
                                      self.replica_endpoint, collectives)
        self.send(self._registration, _REGISTER)
        deadline = time.monotonic() + self._timeouts.register + self._timeouts.dead_after
        with self._cond:
            while self._ack is None:
                self._raise_if_broken()
                ended = next((a for a in self._actions if a.kind is ActionKind.DUMP_AND_EXIT), None)
                if ended is not None:  # left queued: follow() still obeys it
                    raise ProcessorError(f"rank {self.rank}: the controller ended the job before "
                                         f"registration completed: {ended.reason}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProcessorError(f"rank {self.rank}: no answer from the controller at "
                                         f"{self._config.controller_address} within "
                                         f"{self._timeouts.register:g} s (timeouts.register): "
                                         f"{channel.UNREACHABLE_CAUSES}")
                self._cond.wait(left)
            log.info("rank=%d incarnation=%d registered; controller state %s", self.rank, self.incarnation,
                     self._ack.state)
            return self._ack

    def finished(self, step: int) -> None:
        """Report ``step`` finished: one frame, no answer awaited, on a socket of the calling
        (training) thread so the I/O thread is not woken every step; a frame that cannot be
        queued is dropped (the next one supersedes it)."""
        limit = None if self.report_limit is None else self.report_limit(step)
        with self.report_lock:
            report = self.follower.report(step, limit)
        if report is None:
            return  # held back (release_reports() sends it), or nothing new
        sock = self._report_socket
        if sock is None:
            if self._closed:
                raise ProcessorError(f"rank {self.rank}: processor is closed")
            sock = self._report_socket = channel.report_dealer(self._context, self._keys,
                                                               self._config.control_address,
                                                               self.identity + REPORT_SUFFIX)
        try:
            sock.send(encode_step_report(self.rank, report.step, report.round), zmq.NOBLOCK)
        except zmq.Again:
            return
        self._reported_at = time.monotonic()  # the controller heard from this rank: no heartbeat due

    def release_reports(self) -> None:
        """The report limit rose: report the newest step it now allows (any thread)."""
        limit = self.report_limit(self.follower.position) if self.report_limit is not None else self.follower.position
        with self.report_lock:
            report = self.follower.release(limit)
        if report is not None:
            try:
                self.send(report)
            except ProcessorError:
                pass  # closed or broken: the training thread finds out

    def report_replica(self, report: ReplicaReport) -> None:
        """Tell the controller what this rank's replica holds (any thread; the answer is ignored)."""
        self.send(report)

    def done(self, step: int) -> None:
        """Tell the controller this rank finished training at ``step``."""
        self.send(Done(self.rank, step))

    def wait_window(self, step: int) -> Optional[Action]:
        """Before capturing ``step``: return at once when the window allows it, else wait; an
        action that arrives first is returned. A pending action does not stop a capture the
        window allows: the step is consistent, and a PAUSE that finds it held replays less."""
        if self.follower.may_capture(step):
            return None
        return self._wait_until(lambda: self.follower.may_capture(step))

    def wait_peers(self, step: int) -> Optional[Action]:
        """Wait until every rank finished ``step`` (lockstep); an action that arrives first is returned."""
        return self._wait_until(lambda: self.follower.slowest >= step)

    def _wait_until(self, ready: Callable[[], bool]) -> Optional[Action]:
        if ready() and not self._actions:
            return None
        with self._cond:
            while not ready():
                if self._actions:
                    return self._actions.popleft()
                self._raise_if_broken()
                self._cond.wait(self._timeouts.dead_after)
            return self._actions.popleft() if self._actions else None

    def poll_action(self) -> Optional[Action]:
        """The next pending action, or None; does not block."""
        if not self._actions:
            if self._error is not None:
                self._raise_if_broken()
            return None
        with self._cond:
            return self._actions.popleft() if self._actions else None

    def wait_action(self, timeout: Optional[float] = None) -> Action:
        """Block until the next action; TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._actions:
                self._raise_if_broken()
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank}: no action from the controller within {timeout:g} s")
                self._cond.wait(left)
            return self._actions.popleft()

    def report_cost(self, step_time: float, capture_time: float) -> None:
        """Tell the job what a step and a snapshot cost this rank (seconds), for its cadence."""
        self.send(CostReport(self.rank, round(step_time, 6), round(capture_time, 6)))

    def report_pace(self, steps: int, seconds: float) -> None:
        """Tell the job this rank's median own work per step, ``seconds``, over its last ``steps`` steps
        (:mod:`mindft.flow.slow`)."""
        self.send(Pace(self.rank, steps, round(seconds, 6)))

    def _set_cadence(self, wire: tuple[int, ...]) -> None:
        if not wire or self._own_cadence:
            return
        try:
            schedule = Schedule.from_wire(wire)
        except ScheduleError as error:
            log.warning("rank=%d ignored a bad cadence from the controller: %s", self.rank, error)
            return
        differs = self.follower.on_cadence(schedule)
        if differs is not None:  # the flow never announces this; say so loudly if it ever does
            log.error("rank=%d the new snapshot cadence changes step %d, already decided", self.rank, differs)
        log.info("rank=%d snapshot cadence %s", self.rank, schedule.segments[-1])

    def report_fault(self, kind: FaultKind, detail: str = "", step: Optional[int] = None,
                     since: Optional[float] = None) -> None:
        """Tell the controller this rank hit ``kind`` inside ``step`` (default: the next one) at
        ``since`` (``time.monotonic()``; default: now)."""
        age = 0.0 if since is None else max(0.0, round(time.monotonic() - since, 6))
        self.send(FaultReport(self.rank, self.follower.position + 1 if step is None else step,
                               FaultKind(kind), detail, age))

    def close(self) -> None:
        """Flush pending frames (up to the linger time), stop the I/O thread, free the sockets."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        with self._send_lock:
            try:
                self._pipe_out.send(_STOP, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._thread.join(channel.DEALER_LINGER_MS / 1000 + 2.0)
        with self._send_lock:
            self._pipe_out.close(0)
        if self._report_socket is not None:
            self._report_socket.close()
        if self._thread.is_alive():
            self._context.destroy(0)
        else:
            self._context.term()

    @property
    def broken(self) -> bool:
        """The link to the controller is gone: it fell silent for good, or :meth:`fail` broke it."""
        return self._error is not None

    def fail(self, reason: str) -> None:
        """Break the link from outside (any thread): every wait and send raises ProcessorError(reason)."""
        with self._cond:
            if self._error is None:
                self._error = reason
            self._cond.notify_all()

    def _raise_if_broken(self) -> None:
        if self._closed:
            raise ProcessorError(f"rank {self.rank}: processor is closed")
        if self._error is not None:
            raise ProcessorError(self._error)

    def send(self, message: Message, tag: bytes = _MESSAGE) -> None:
        """Queue ``message`` for the I/O thread (any thread); ProcessorError once closed or broken."""
        frame = tag + encode(message)
        with self._send_lock:
            self._raise_if_broken()
            try:
                self._pipe_out.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError as error:
                raise ProcessorError(f"rank {self.rank}: I/O thread is not accepting frames ({error})") from None

    def _run(self) -> None:
        try:
            error = link.run_link(self._context, self._keys, self._config, self.identity, self._pipe_in,
                                     lambda: encode_heartbeat(self.rank, self.incarnation, self.follower.position),
                                     lambda: self._reported_at, self._receive_all, self._register_again)
        except Exception as failure:  # the training thread must learn about it, not hang
            log.exception("rank=%d processor I/O thread failed", self.rank)
            error = f"rank {self.rank}: processor I/O thread failed: {failure}"
        finally:
            self._pipe_in.close(0)
        if error is not None:
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _register_again(self) -> bytes:
        """The registration after a reconnect: as first sent, with how far the rank got since."""
        with self._cond:
            progress = self.follower.position if self._ack is not None else -1
        return encode(dataclasses.replace(self._registration, progress=progress))

    def _receive_all(self, sock: zmq.Socket) -> None:
        for message in link.receive_all(sock, f"rank={self.rank}"):
            kind = type(message)
            if kind is Heartbeat or kind is Reply:  # a Reply answers report_replica: nothing to do
                continue
            with self._cond:
                if kind is Progress:
                    self.follower.on_progress(message.step)
                elif kind is Action:
                    self._endpoints.update(message.endpoints)
                    self._actions.append(message)
                elif kind is Cadence:
                    self._set_cadence(message.schedule)
                    continue
                elif kind is RegisterAck:
                    self._endpoints = dict(message.endpoints)
                    self._set_cadence(message.cadence)
                    self._ack = message
                else:
                    log.warning("rank=%d ignored unexpected %s", self.rank, kind.__name__)
                    continue
                self._cond.notify_all()
