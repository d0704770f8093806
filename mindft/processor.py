"""One rank's end of the control channel: the ZeroMQ shell around :class:`mindft.flow.Follower`.

The training thread calls :class:`Processor`; one I/O thread owns the DEALER socket. Frames go
to it through an inproc pipe; actions and progress come back under a condition. Any frame
proves its sender alive, so the I/O thread sends a heartbeat only after an interval in which
the rank sent nothing else (step reports count) or heard nothing; the controller answers
each. Paranoid-Pirate style, it treats a controller silent for ``timeouts.dead_after`` as
unreachable: it reconnects (same identity), re-sends the registration, and gives up after
``timeouts.connect_retries`` silent periods in a row.

:meth:`Processor.follow` is the only rank-side loop of the recovery flow: it asks the follower
what each action means and carries it out through the rank's :class:`RankHooks`.
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from typing import Callable, Optional, Sequence

import zmq

from mindft import channel
from mindft.config import MindftConfig
from mindft.flow import REPORT_SUFFIX, Finished, Follower, RankHooks, Resumed
from mindft.flow.cadence import Schedule, ScheduleError
from mindft.keys import CurveKeys, job_keys
from mindft.protocol import (Action, ActionKind, Cadence, CostReport, Done, FaultKind, FaultReport, Heartbeat, Message, Progress,
                             ProtocolError, Register, RegisterAck, ReplicaReport, Reply, StepReport, decode, encode,
                             encode_heartbeat, encode_step_report)

log = logging.getLogger(__name__)

# One-byte tags in front of each frame on the inproc pipe from the training thread.
_MESSAGE, _REGISTER, _STOP = b"M", b"R", b"S"
_pipe_ids = itertools.count()


class ProcessorError(RuntimeError):
    """The controller is unreachable, or the processor was used after close()."""


class Processor:
    """One rank's connection to the controller (see the module docstring).

    The incarnation defaults to ``config.restart_count`` (set by mindft-launch); the socket
    identity is ``rank<R>.inc<I>``, so a restarted rank is a new peer.

    The snapshot cadence is the job's (RegisterAck, Cadence), unless it is fixed, by
    ``snapshot_every`` here or MINDFT_SNAPSHOT_EVERY: then this rank keeps that one (every
    rank must be given the same; mindft-launch gives the controller the same environment).
    :attr:`reports_costs` says whether the job wants this rank's :meth:`report_cost`.

    :attr:`report_limit` (when set) caps the step a report may claim finished: a rank that
    replicates its own snapshots reports a capture step only once its replica arrived
    (:class:`mindft.replica.RankReplication`), and calls :meth:`release_reports` when
    the cap rises.
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
        self.finished_job = False  # FINISH received: every rank is done
        self.lockstep = False  # end_step waits for every rank to finish the step (see end_step)
        self._report_socket: Optional[zmq.Socket] = None  # the training thread's, for step reports
        self._reported_at = 0.0  # monotonic time of the last step report sent (read by the I/O thread)
        self.report_limit: Optional[Callable[[int], int]] = None  # step finished → the newest step to report
        self._reported: tuple[int, int] = (-1, -1)  # (round, step) of the newest step report sent
        self._report_lock = threading.Lock()
        self._config = config
        self._timeouts = config.timeouts
        self._keys = keys if keys is not None else job_keys(config)
        self._context = zmq.Context()
        self.identity = f"rank{self.rank}.inc{self.incarnation}".encode()
        self._cond = threading.Condition()
        self._actions: collections.deque[Action] = collections.deque()
        self._ack: Optional[RegisterAck] = None
        self._endpoints: dict[int, str] = {}
        self._error: Optional[str] = None
        self._closed = False
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

    def endpoint_of(self, rank: int) -> Optional[str]:
        """Where ``rank`` keeps replicas, from the latest map (None: not known)."""
        with self._cond:
            return self._endpoints.get(rank) or None

    def register(self, held_steps: Sequence[int] = (), collectives: bool = False) -> RegisterAck:
        """Join the job and wait at the start barrier (or get an immediate ack after a restart).

        Raises :class:`ProcessorError` if the controller does not answer within
        ``timeouts.register``, stays unreachable, or ends the job meanwhile.
        """
        self._send(Register(self.rank, self.incarnation, os.getpid(), tuple(sorted(held_steps)),
                            self.replica_endpoint, collectives), _REGISTER)
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
                                         f"{self._timeouts.register:g} s (timeouts.register); is it running?")
                self._cond.wait(left)
            log.info("rank=%d incarnation=%d registered; controller state %s", self.rank, self.incarnation,
                     self._ack.state)
            return self._ack

    # ---- the training thread's per-step calls (no waiting in the common case) -------------

    def finished(self, step: int) -> None:
        """Report ``step`` finished: one frame, no answer awaited.

        It goes out on a socket of the calling (training) thread, so the I/O thread is not
        woken every step; a frame that cannot be queued is dropped (the next one supersedes it).
        """
        report = self.follower.finished(step)
        step = self._reportable(report.step, report.round)
        if step is None:
            return  # held back: release_reports() sends it
        sock = self._report_socket
        if sock is None:
            if self._closed:
                raise ProcessorError(f"rank {self.rank}: processor is closed")
            sock = self._report_socket = channel.dealer(self._context, self._keys, self._config.controller_address,
                                                        self.identity + REPORT_SUFFIX)
            sock.setsockopt(zmq.LINGER, channel.REPORT_LINGER_MS)
        try:
            sock.send(encode_step_report(self.rank, step, report.round), zmq.NOBLOCK)
        except zmq.Again:
            return
        self._reported_at = time.monotonic()  # the controller heard from this rank: no heartbeat due

    def _reportable(self, step: int, round: int) -> Optional[int]:
        """The step to report now for ``step`` finished in ``round`` (None: nothing new to say)."""
        if self.report_limit is not None:
            step = min(step, self.report_limit(step))
        with self._report_lock:
            if (round, step) <= self._reported:
                return None
            self._reported = (round, step)
        return step

    def release_reports(self) -> None:
        """The report limit rose: report the newest step it now allows (any thread)."""
        if self.follower.recovering:
            return  # the recovery decides where every rank is; training reports again after RESUME
        round, position = self.follower.round, self.follower.position
        step = self._reportable(position, round)
        if step is not None:
            try:
                self._send(StepReport(self.rank, step, round))
            except ProcessorError:
                pass  # closed or broken: the training thread finds out

    def report_replica(self, report: ReplicaReport) -> None:
        """Tell the controller what this rank's replica holds (any thread; the answer is ignored)."""
        self._send(report)

    def wait_window(self, step: int) -> Optional[Action]:
        """Before capturing ``step``: return at once when the window allows it, else wait.

        Returns an action if one arrives first (the caller follows it). An action already
        pending does not stop a capture the window allows: the step is finished and
        consistent, and a PAUSE that finds it held replays one snapshot period less.
        """
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
        self._send(CostReport(self.rank, round(step_time, 6), round(capture_time, 6)))

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
        else:
            log.info("rank=%d snapshot cadence %s", self.rank, schedule.segments[-1])

    def report_fault(self, kind: FaultKind, detail: str = "", step: Optional[int] = None) -> None:
        """Tell the controller this rank hit ``kind`` inside ``step`` (default: the next one)."""
        self._send(FaultReport(self.rank, self.follower.position + 1 if step is None else step,
                               FaultKind(kind), detail))

    # ---- the recovery loop ----------------------------------------------------------------

    def follow(self, hooks: RankHooks, action: Optional[Action] = None) -> Optional[int]:
        """Obey the controller from ``action`` (or the next one) until training may go on.

        Returns the step training resumes after (a RESUME), or None when an injected fault
        was armed outside a recovery or the job finished (:attr:`finished_job` tells which).
        ``hooks.dump_and_exit`` ends the process on DUMP_AND_EXIT.
        """
        while True:
            if action is None:
                try:
                    action = self.wait_action()
                except ProcessorError as error:
                    hooks.dump_and_exit(-1, f"lost the controller: {error}")
            log.info("rank=%d %s step=%d round=%d", self.rank, action.kind.name, action.step, action.round)
            with self._report_lock:
                self._reported = (-1, -1)  # a recovery resets every rank's progress: report afresh
            ack, outcome = self.follower.obey(action, hooks)
            if ack is not None:
                self._send(ack)
            if isinstance(outcome, Resumed):
                return outcome.step
            if isinstance(outcome, Finished):
                self.finished_job = True
                return None
            if outcome is not None:
                return None
            action = None

    def end_step(self, step: int, hooks: RankHooks, capture: Callable[[int], None]) -> Optional[int]:
        """The end of ``step``: on a capture step wait for the window and ``capture(step)``, then
        report the step and obey a pending action. Returns the step a recovery rolled training
        back to (or resumed after), None to go straight on.

        With :attr:`lockstep` the rank then waits until every rank finished ``step``: in a job
        whose collectives cannot be repaired in place, a rank that faults at a step boundary
        finds every peer at the same boundary (not blocked in the next step's all-reduce), so
        the recovery rolls back in place instead of restarting every worker."""
        if self.follower.is_capture_step(step):
            while (action := self.wait_window(step)) is not None:
                resumed = self.follow(hooks, action)
                if resumed is not None:
                    return resumed
            capture(step)
        self.finished(step)
        if self.lockstep:
            while (action := self.wait_peers(step)) is not None:
                resumed = self.follow(hooks, action)
                if resumed is not None:
                    return resumed
            return None
        action = self.poll_action()
        return None if action is None else self.follow(hooks, action)

    def finish(self, step: int, hooks: RankHooks) -> Optional[int]:
        """Report Done at ``step`` and wait for every rank: None when the job is finished, or
        the step to continue training after when a late fault rolled everyone back."""
        self._send(Done(self.rank, step))
        while not self.finished_job:
            resumed = self.follow(hooks)
            if resumed is not None:
                return resumed
        return None

    # ---- lifecycle ------------------------------------------------------------------------

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

    def __enter__(self) -> Processor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise_if_broken(self) -> None:
        if self._closed:
            raise ProcessorError(f"rank {self.rank}: processor is closed")
        if self._error is not None:
            raise ProcessorError(self._error)

    def _send(self, message: Message, tag: bytes = _MESSAGE) -> None:
        frame = tag + encode(message)
        with self._send_lock:
            self._raise_if_broken()
            try:
                self._pipe_out.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError as error:
                raise ProcessorError(f"rank {self.rank}: I/O thread is not accepting frames ({error})") from None

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

    def _open(self) -> zmq.Socket:
        return channel.dealer(self._context, self._keys, self._config.controller_address, self.identity)

    def _loop(self) -> None:
        interval, dead_after = self._timeouts.heartbeat_interval, self._timeouts.dead_after
        retries = self._timeouts.connect_retries
        sock = self._open()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._pipe_in, zmq.POLLIN)
        register_frame: Optional[bytes] = None  # re-sent after every reconnect
        last_heard = last_sent = last_beat = time.monotonic()
        silent_periods = 0
        heard = False
        # A rank started by hand (not by mindft-launch) has nobody to wait for: one silent period.
        first_contact_retries = retries if self._config.launcher_pid else 1
        try:
            while True:
                now = time.monotonic()
                if register_frame is None:
                    timeout = interval
                else:
                    # A heartbeat is due once the rank sent nothing (step reports included) or
                    # heard nothing for an interval; the controller is lost after dead_after.
                    beat_due = min(max(last_sent, self._reported_at), max(last_heard, last_beat)) + interval
                    timeout = max(0.0, min(beat_due, last_heard + dead_after) - now)
                ready = dict(poller.poll(timeout * 1000.0))
                if self._pipe_in in ready:
                    while True:
                        try:
                            data = self._pipe_in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        tag, frame = data[:1], data[1:]
                        if tag == _STOP:
                            return
                        if tag == _REGISTER:
                            register_frame, last_heard = frame, time.monotonic()
                        try:
                            sock.send(frame, zmq.NOBLOCK)
                            last_sent = time.monotonic()
                        except zmq.Again:  # the silence check below reconnects and re-registers
                            log.warning("rank=%d send queue full; frame dropped", self.rank)
                if sock in ready:
                    silent_periods, last_heard, heard = 0, time.monotonic(), True
                    self._receive_all(sock)
                if register_frame is None:
                    continue  # not part of a job yet: nothing to heartbeat or time out
                now = time.monotonic()
                if (now - max(last_sent, self._reported_at) >= interval
                        or now - max(last_heard, last_beat) >= interval):
                    last_sent = last_beat = now  # also when dropped: the next try is an interval later
                    try:
                        sock.send(encode_heartbeat(self.rank, self.incarnation, self.follower.position), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                if now - last_heard > dead_after:
                    silent_periods += 1
                    if not heard and silent_periods >= first_contact_retries:
                        self._fail(f"rank {self.rank}: MS_ENABLE_TFT is set but no mindft controller answers at "
                                   f"{self._config.controller_address} (waited {silent_periods * dead_after:g} s): "
                                   f"start the job with mindft-launch, or unset MS_ENABLE_TFT to train "
                                   f"without fault tolerance")
                        return
                    if silent_periods >= retries:
                        self._fail(f"rank {self.rank}: controller at {self._config.controller_address} "
                                   f"silent for {retries} periods of {dead_after:g} s "
                                   f"(timeouts.connect_retries); is it running, and do both sides use the same key?")
                        return
                    log.log(logging.WARNING if heard else logging.DEBUG,
                            "rank=%d controller silent for %.2f s; reconnecting (attempt %d of %d)",
                            self.rank, now - last_heard, silent_periods + 1, retries)
                    poller.unregister(sock)
                    sock.close(0)
                    sock = self._open()
                    poller.register(sock, zmq.POLLIN)
                    sock.send(register_frame, zmq.NOBLOCK)
                    last_heard = last_sent = last_beat = now
        finally:
            sock.close(channel.DEALER_LINGER_MS)

    def _fail(self, error: str) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

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
