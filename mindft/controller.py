"""The job's controller: one ZeroMQ ROUTER that runs the pause/repair/rollback/resume flow.

Ranks (``mindft.processor.Processor``, one DEALER each) register, report every step,
heartbeat and report faults; the controller keeps a registry of ranks and an explicit
state machine (:class:`ControllerState`, :data:`TRANSITIONS`):

    STARTING → NORMAL → PAUSING → REPAIRING → ROLLBACK → RESUMING → NORMAL
    any non-terminal state → FAILED;  NORMAL → DONE
    PAUSING / REPAIRING / ROLLBACK / RESUMING → PAUSING  (a further fault restarts recovery)

All socket work happens on the thread that runs :meth:`Controller.serve`; other threads
(the reset watcher) hand events in through :meth:`Controller.on_device_event`.
"""
from __future__ import annotations

import collections
import enum
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import zmq

from mindft.config import ConfigError, MindftConfig, load_config
from mindft.keys import job_keys, secure_server, start_authenticator
from mindft.protocol import (MAX_FRAME, Ack, Action, ActionKind, DeviceEvent, DeviceStatus, Done,
                             FaultKind, FaultReport, Heartbeat, InjectRequest, Message, ProcessExit,
                             ProtocolError, RankStatus, Register, RegisterAck, Reply, StatusReply,
                             StatusRequest, StepPhase, StepReport, decode, encode)

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2
# ROUTER send queue per peer: a broadcast puts one frame in each peer's pipe, so a few
# thousand is plenty; beyond it ZeroMQ drops (a rank that far behind is declared dead anyway).
SEND_HWM = 10_000
RECEIVE_HWM = 100_000
# Keep unsent DUMP_AND_EXIT frames this long after serve() returns.
CLOSE_LINGER_MS = 2_000
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
# Messages handled per poll wake-up before timers are checked again.
_BATCH = 10_000


class IllegalTransition(RuntimeError):
    """The controller was asked to move between two states the table does not connect."""


class ControllerState(str, enum.Enum):
    """Where the job is in the recovery flow (see the module docstring)."""

    STARTING = "STARTING"    # waiting for every rank to register (start barrier)
    NORMAL = "NORMAL"        # training; one COMMIT per step
    PAUSING = "PAUSING"      # every live rank told to stop at its next step boundary
    REPAIRING = "REPAIRING"  # waiting for devices to recover / restarted ranks to re-register
    ROLLBACK = "ROLLBACK"    # every rank restores the repair step
    RESUMING = "RESUMING"    # barrier before training continues
    FAILED = "FAILED"        # terminal: ranks dump and exit, job exits non-zero
    DONE = "DONE"            # terminal: every rank finished


_S = ControllerState
_RECOVERY = frozenset({_S.PAUSING, _S.REPAIRING, _S.ROLLBACK, _S.RESUMING})
TRANSITIONS: dict[ControllerState, frozenset[ControllerState]] = {
    _S.STARTING: frozenset({_S.NORMAL, _S.FAILED}),
    _S.NORMAL: frozenset({_S.PAUSING, _S.FAILED, _S.DONE}),
    _S.PAUSING: frozenset({_S.REPAIRING, _S.PAUSING, _S.FAILED}),
    _S.REPAIRING: frozenset({_S.ROLLBACK, _S.PAUSING, _S.FAILED}),
    _S.ROLLBACK: frozenset({_S.RESUMING, _S.PAUSING, _S.FAILED}),
    _S.RESUMING: frozenset({_S.NORMAL, _S.PAUSING, _S.FAILED}),
    _S.FAILED: frozenset(),
    _S.DONE: frozenset(),
}


class StateMachine:
    """The controller's state and the only place it changes (illegal moves raise)."""

    def __init__(self, state: ControllerState = ControllerState.STARTING) -> None:
        self.state = state
        self.entered = time.monotonic()
        # Recent (state, entered) pairs, for per-phase timings in logs and benchmarks.
        self.history: collections.deque[tuple[ControllerState, float]] = collections.deque(
            [(state, self.entered)], maxlen=256)

    def can(self, target: ControllerState) -> bool:
        """True when the table allows moving from the current state to ``target``."""
        return target in TRANSITIONS[self.state]

    def transition(self, target: ControllerState, why: str = "") -> None:
        """Move to ``target`` or raise :class:`IllegalTransition`."""
        if not self.can(target):
            allowed = ", ".join(sorted(s.value for s in TRANSITIONS[self.state])) or "none (terminal)"
            raise IllegalTransition(f"illegal controller transition {self.state.value} → "
                                    f"{target.value}; allowed from {self.state.value}: {allowed}")
        log.info("controller state %s → %s%s", self.state.value, target.value,
                 f" ({why})" if why else "")
        self.state = target
        self.entered = time.monotonic()
        self.history.append((target, self.entered))


@dataclass(frozen=True)
class JobResult:
    """What :meth:`Controller.serve` returns: the job's exit code and why."""

    exit_code: int
    reason: str


class RankState(str, enum.Enum):
    """The controller's view of one rank."""

    REGISTERED = "registered"  # waiting at the start barrier
    RUNNING = "running"
    FAULTY = "faulty"          # alive, reported or caused a fault, waiting
    DEAD = "dead"              # silent (hung) or exited; needs a new incarnation
    PAUSED = "paused"
    RESTORED = "restored"
    RESUMED = "resumed"
    DONE = "done"


@dataclass
class _Rank:
    rank: int
    identity: bytes
    incarnation: int
    pid: int
    replica_endpoint: str
    held_steps: tuple[int, ...]
    last_seen: float
    state: RankState = RankState.REGISTERED
    step: int = -1       # last step the rank reported (started or finished)
    finished: int = -1   # last step it reported FINISHED
    restarts: int = 0

    @property
    def alive(self) -> bool:
        return self.state is not RankState.DEAD

    @property
    def participating(self) -> bool:
        """Takes part in commits and recoveries (finished ranks have closed their processor)."""
        return self.state is not RankState.DONE


@dataclass
class _Fault:
    kind: FaultKind
    step: int
    detail: str
    device_pending: bool = False   # DEVICE_RESET: until the reset watcher reports recovery
    process_pending: bool = False  # dead/hung: until a new incarnation registers

    def describe(self, rank: int) -> str:
        return f"rank {rank} {self.kind.name} at step {self.step}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class _Recovery:
    round: int = 0
    started: float = 0.0
    faults: dict[int, _Fault] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    expected: Optional[set[int]] = None
    repair_step: int = -1
    deadline: float = 0.0


class Controller:
    """The job's coordinator; see the module docstring for the flow.

    ``events`` is an optional iterable of device events (``mindft.resetwatch`` objects,
    recognised by class name: DeviceFaulty / DeviceRecovered / DeviceFailed); it is
    consumed on a background thread and fed to :meth:`on_device_event`.
    The socket is bound in the constructor, so :attr:`endpoint` is known at once
    (``controller_port=0`` picks a free port).
    """

    def __init__(self, config: MindftConfig, events: Optional[Iterable[Any]] = None) -> None:
        self._config = config
        self._timeouts = config.timeouts
        self._wake_lock = threading.Lock()
        self._closed = False
        self._keys = job_keys(config)
        self._context = zmq.Context()
        self._context.setsockopt(zmq.LINGER, 0)
        self._authenticator = start_authenticator(self._context, self._keys)
        self._socket = self._context.socket(zmq.ROUTER)
        # A processor that reconnects with the same identity replaces its old connection.
        # ROUTER_MANDATORY stays off: a frame for a vanished peer is dropped, and the
        # heartbeat check (not a send error) decides that the peer is dead.
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        # libzmq drops a peer that sends a bigger frame before we ever see it.
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self._socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        secure_server(self._socket, self._keys)
        port = "*" if config.controller_port == 0 else str(config.controller_port)
        try:
            self._socket.bind(f"tcp://{config.controller_ip}:{port}")
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_address = f"inproc://mindft-controller-wake-{id(self)}"
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_in.bind(self._wake_address)
        self._wake_out = self._context.socket(zmq.PAIR)
        self._wake_out.connect(self._wake_address)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._machine = StateMachine()
        self._ranks: dict[int, _Rank] = {}
        self._by_identity: dict[bytes, int] = {}
        self._barrier_endpoints: dict[int, str] = {}
        self._committed = -1
        self._votes: dict[int, int] = {}
        self._voters = config.world_size  # ranks still training (not DONE)
        self._recovery = _Recovery()
        self._recoveries: list[float] = []
        self._recovery_phases: list[dict[str, float]] = []
        self._result: Optional[JobResult] = None
        self._failure = ""
        self._started_at = time.monotonic()
        self._deadline = self._started_at + self._timeouts.register
        self._thread: Optional[threading.Thread] = None
        self._thread_result: Optional[JobResult] = None
        self.dropped_frames = 0
        self._status_lock = threading.Lock()
        self._published_status = self.status()
        if events is not None:
            threading.Thread(target=self._pump_events, args=(events,), daemon=True,
                             name="mindft-controller-events").start()
        log.info("controller listening on %s for %d ranks (%s)", self.endpoint, config.world_size,
                 "insecure" if self._keys is None else "CurveZMQ")

    @property
    def state(self) -> ControllerState:
        """The current state of the recovery flow."""
        return self._machine.state

    @property
    def committed_step(self) -> int:
        """The last step every rank finished (COMMIT), -1 before the first."""
        return self._committed

    @property
    def recovery_times(self) -> tuple[float, ...]:
        """Wall time of each completed recovery, PAUSING entry to NORMAL, in seconds."""
        return tuple(self._recoveries)

    @property
    def recovery_phases(self) -> tuple[dict[str, float], ...]:
        """Seconds spent in each state (PAUSING, REPAIRING, ROLLBACK, RESUMING) per recovery."""
        return tuple(self._recovery_phases)

    def on_device_event(self, event: Any) -> None:
        """Hand a device event in from any thread (DeviceFaulty / DeviceRecovered / DeviceFailed)."""
        self._inbox.put(event)
        self._wake()

    def on_process_exit(self, rank: int, returncode: int, pid: int, *, final: bool = False) -> None:
        """Hand a rank's process exit in from any thread (the launcher on this node).

        ``final``: the launcher will not start the rank again (out of restarts, or it gave
        up on its own), so the job cannot recover it and fails now instead of at a timeout.
        """
        self._inbox.put(_ProcessExited(rank, returncode, pid, final))
        self._wake()

    def latest_status(self) -> StatusReply:
        """The status the controller's loop last published; safe from any thread."""
        with self._status_lock:
            return self._published_status

    def start(self) -> threading.Thread:
        """Run :meth:`serve` on a background thread; :meth:`stop` or :meth:`join` it."""
        def run() -> None:
            self._thread_result = self.serve()
        self._thread = threading.Thread(target=run, name="mindft-controller", daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: Optional[float] = None) -> Optional[JobResult]:
        """Wait for the thread started by :meth:`start`; its result, or None if still running."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread_result

    def stop(self, timeout: float = 5.0) -> Optional[JobResult]:
        """Ask :meth:`serve` to return (exit code 1 unless the job already ended) and wait."""
        self._inbox.put(_STOP)
        self._wake()
        return self.join(timeout)

    def serve(self) -> JobResult:
        """Run the flow until DONE, FAILED or :meth:`stop`; close the sockets; return the result."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        interval = self._timeouts.heartbeat_interval
        next_beat = time.monotonic()
        try:
            while self._result is None:
                now = time.monotonic()
                wait = max(0.0, min(next_beat, self._deadline) - now)
                ready = dict(poller.poll(wait * 1000.0))
                if self._socket in ready:
                    self._drain_socket()
                if self._wake_in in ready:
                    self._drain_wake()
                self._drain_inbox()
                now = time.monotonic()
                if self._result is None and now >= next_beat:
                    next_beat = now + interval
                    self._beat(now)
                if self._result is None and now >= self._deadline:
                    self._phase_timeout()
                self._publish_status()
        finally:
            self._publish_status()
            self._close_sockets()
        assert self._result is not None
        log.info("controller finished: exit code %d: %s", self._result.exit_code, self._result.reason)
        return self._result

    def _publish_status(self) -> None:
        status = self.status()
        with self._status_lock:
            self._published_status = status

    def _wake(self) -> None:
        with self._wake_lock:
            if self._closed:
                return
            try:
                self._wake_out.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a wake-up is already pending

    def _drain_wake(self) -> None:
        while True:
            try:
                self._wake_in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _drain_inbox(self) -> None:
        while self._result is None:
            try:
                event = self._inbox.get_nowait()
            except queue.Empty:
                return
            if event is _STOP:
                self._result = JobResult(EXIT_FAILED, "controller stopped before the job finished")
                return
            if isinstance(event, _ProcessExited):
                self._local_process_exit(event)
            else:
                self._device_event(event)

    def _pump_events(self, events: Iterable[Any]) -> None:
        try:
            for event in events:
                if self._result is not None or self._closed:
                    return
                self.on_device_event(event)
        except Exception:  # the watcher is outside our control; the job continues without it
            log.exception("device event source failed; device events are no longer seen")

    def _close_sockets(self) -> None:
        with self._wake_lock:
            if self._closed:
                return
            self._closed = True
        for sock, linger in ((getattr(self, "_socket", None), CLOSE_LINGER_MS),
                             (getattr(self, "_wake_in", None), 0), (getattr(self, "_wake_out", None), 0)):
            if sock is not None:
                sock.close(linger)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    def _drain_socket(self) -> None:
        for _ in range(_BATCH):
            try:
                frames = self._socket.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self._drop(frames[0] if frames else b"?", f"expected 1 frame, got {len(frames) - 1}")
                continue
            identity, frame = frames
            try:
                message = decode(frame)
            except ProtocolError as error:
                self._drop(identity, str(error))
                continue
            try:
                self._handle(identity, message)
            except IllegalTransition:
                raise  # the flow itself is broken: fail loudly rather than limp on
            except Exception:  # one bad message must not take the job down
                log.exception("error handling %s from peer %r; message dropped", type(message).__name__,
                              identity[:32])
                self.dropped_frames += 1
            if self._result is not None:
                return

    def _drop(self, identity: bytes, reason: str) -> None:
        self.dropped_frames += 1
        log.warning("dropped a frame from peer %r: %s", identity[:32], reason)

    def _send(self, identity: bytes, message: Message) -> None:
        self._send_frame(identity, encode(message))

    def _send_frame(self, identity: bytes, frame: bytes) -> None:
        # Two plain sends with int flags: send_multipart's per-call checks dominate a broadcast.
        send = self._socket.send
        try:
            send(identity, _MORE_NOBLOCK)
            send(frame, _NOBLOCK)
        except zmq.ZMQError as error:  # peer gone or its pipe full: heartbeats will tell
            log.debug("could not send to %r: %s", identity, error)

    def _broadcast(self, message: Message) -> None:
        frame = encode(message)
        for info in self._ranks.values():
            if info.alive and info.participating:
                self._send_frame(info.identity, frame)

    def _sender(self, identity: bytes, rank: int, what: str) -> Optional[_Rank]:
        """The registry entry if ``identity`` is the current incarnation of ``rank``."""
        info = self._ranks.get(rank)
        if info is None or info.identity != identity:
            self._drop(identity, f"{what} for rank {rank} from an unregistered or stale incarnation")
            return None
        if not info.alive:
            log.info("ignoring %s from rank %d declared dead (incarnation %d)", what, rank, info.incarnation)
            return None
        info.last_seen = time.monotonic()
        return info

    def _handle(self, identity: bytes, message: Message) -> None:
        if isinstance(message, Heartbeat):
            info = self._sender(identity, message.rank, "heartbeat")
            if info is not None:
                info.step = max(info.step, message.step)
        elif isinstance(message, StepReport):
            self._on_step(identity, message)
        elif isinstance(message, Ack):
            self._on_ack(identity, message)
        elif isinstance(message, Register):
            self._on_register(identity, message)
        elif isinstance(message, FaultReport):
            info = self._sender(identity, message.rank, "fault report")
            if info is not None:
                self._add_fault(info.rank, message.kind, message.step, message.detail, dead=False)
        elif isinstance(message, Done):
            self._on_done(identity, message)
        elif isinstance(message, StatusRequest):
            self._send(identity, self.status())
        elif isinstance(message, InjectRequest):
            self._send(identity, self._inject(message))
        elif isinstance(message, ProcessExit):
            self._send(identity, self._process_exit(message))
        elif isinstance(message, DeviceEvent):
            if 0 <= message.rank < self._config.world_size:
                self._device_event(message)
                self._send(identity, Reply(True, f"{message.status.value} event for rank {message.rank}"))
            else:
                self._send(identity, Reply(False, f"no rank {message.rank}"))
        else:
            self._drop(identity, f"{type(message).__name__} is not addressed to the controller")

    def _on_register(self, identity: bytes, message: Register) -> None:
        rank = message.rank
        if not 0 <= rank < self._config.world_size:
            self._drop(identity, f"register from rank {rank} outside 0..{self._config.world_size - 1}")
            return
        now = time.monotonic()
        old = self._ranks.get(rank)
        if old is not None and message.incarnation < old.incarnation:
            self._drop(identity, f"register from rank {rank} incarnation {message.incarnation} "
                                 f"older than {old.incarnation}")
            return
        if old is not None and message.incarnation == old.incarnation and old.alive:
            # The same process reconnected (Paranoid Pirate retry): refresh, answer, no fault.
            self._by_identity.pop(old.identity, None)
            old.identity, old.last_seen, old.pid = identity, now, message.pid
            self._by_identity[identity] = rank
            if self.state is not ControllerState.STARTING:
                self._send(identity, self._register_ack())
            return
        if old is not None:
            self._by_identity.pop(old.identity, None)
        info = _Rank(rank=rank, identity=identity, incarnation=message.incarnation, pid=message.pid,
                     replica_endpoint=message.replica_endpoint, held_steps=tuple(message.held_steps),
                     last_seen=now, restarts=message.incarnation if old is None else
                     old.restarts + (message.incarnation > old.incarnation))
        self._ranks[rank] = info
        self._by_identity[identity] = rank
        log.info("rank=%d registered incarnation=%d pid=%d held_steps=%s state=%s", rank,
                 message.incarnation, message.pid, list(message.held_steps), self.state.value)
        state = self.state
        if state is ControllerState.STARTING:
            if len(self._ranks) == self._config.world_size:
                self._start_training()
            return
        if state in (ControllerState.FAILED, ControllerState.DONE):
            return
        info.state = RankState.PAUSED  # a fresh process waits for ROLLBACK
        self._send(identity, self._register_ack())
        fault = self._recovery.faults.get(rank) if state in _RECOVERY else None
        if fault is None:
            # The launcher restarted a rank before we noticed it died: that is a fault too,
            # already repaired by this registration.
            self._add_fault(rank, FaultKind.PROCESS_DIED, old.step if old else -1,
                            f"re-registered as incarnation {message.incarnation}", dead=False)
        else:
            fault.process_pending = False
            fault.kind = FaultKind.PROCESS_DIED if fault.kind is FaultKind.HANG else fault.kind
            log.info("rank=%d restarted (incarnation %d): %s repaired", rank, message.incarnation,
                     fault.kind.name)
            if state in (ControllerState.ROLLBACK, ControllerState.RESUMING):
                # The new process missed this round's ROLLBACK: run the round again.
                self._enter_pausing(f"rank {rank} restarted during {state.value}")
        # Register carries the new process's held steps: it counts as its PAUSE acknowledgement.
        self._recovery.acked.add(rank)
        self._advance()

    def _register_ack(self) -> RegisterAck:
        endpoints = {r: info.replica_endpoint for r, info in sorted(self._ranks.items())}
        return RegisterAck(world_size=self._config.world_size, endpoints=endpoints,
                           state=self.state.value, step=self._committed)

    def _start_training(self) -> None:
        self._machine.transition(ControllerState.NORMAL, f"all {self._config.world_size} ranks registered")
        self._barrier_endpoints = {r: info.replica_endpoint for r, info in self._ranks.items()}
        self._deadline = float("inf")
        now = time.monotonic()
        ack = encode(self._register_ack())
        for info in self._ranks.values():
            info.state, info.last_seen = RankState.RUNNING, now
            self._send_frame(info.identity, ack)

    def _on_step(self, identity: bytes, message: StepReport) -> None:
        info = self._sender(identity, message.rank, "step report")
        if info is None:
            return
        info.step = max(info.step, message.step) if message.phase is StepPhase.STARTED else message.step
        if message.phase is StepPhase.FINISHED and message.step > info.finished:
            info.finished = message.step
            self._votes[message.step] = self._votes.get(message.step, 0) + 1
            if self.state is ControllerState.NORMAL and self._votes[message.step] >= self._voters:
                self._commit(message.step)

    def _commit(self, step: int) -> None:
        if step <= self._committed:
            return
        self._committed = step
        # Votes for steps up to the commit are spent (counting them is O(1) per report).
        for old in [s for s in self._votes if s <= step]:
            del self._votes[old]
        self._broadcast(Action(ActionKind.COMMIT, step, round=self._recovery.round))

    def _try_commit(self) -> None:
        """Recount after the set of voters changed (a rank finished): O(N), rare."""
        active = [info for info in self._ranks.values() if info.participating]
        self._voters = len(active)
        if active:
            self._commit(min(info.finished for info in active))

    def _on_done(self, identity: bytes, message: Done) -> None:
        info = self._sender(identity, message.rank, "done")
        if info is None or info.state is RankState.DONE:
            return
        info.state, info.step = RankState.DONE, message.step
        log.info("rank=%d done at step %d", info.rank, message.step)
        self._voters -= 1
        if self.state is ControllerState.NORMAL:
            if not self._check_done():
                # A finished rank no longer votes: a step it did not reach may now be complete.
                ready = [step for step, votes in self._votes.items() if votes >= self._voters]
                if ready:
                    self._commit(max(ready))

    def _check_done(self) -> bool:
        """In NORMAL with every rank finished: DONE. True if the job is done."""
        if self._voters > 0 or self.state is not ControllerState.NORMAL:
            return False
        self._machine.transition(ControllerState.DONE, "every rank finished")
        self._result = JobResult(EXIT_OK, f"all {len(self._ranks)} ranks finished; last committed "
                                          f"step {self._committed}, {len(self._recoveries)} recoveries")
        return True

    def _on_ack(self, identity: bytes, message: Ack) -> None:
        info = self._sender(identity, message.rank, f"{message.action.name} ack")
        if info is None:
            return
        rec, state = self._recovery, self.state
        if message.round != rec.round:
            log.info("rank=%d ignoring %s ack of round %d (current round %d)", info.rank,
                     message.action.name, message.round, rec.round)
            return
        expected = {ControllerState.PAUSING: ActionKind.PAUSE, ControllerState.ROLLBACK: ActionKind.ROLLBACK,
                    ControllerState.RESUMING: ActionKind.RESUME}.get(state)
        if message.action is not expected:
            if message.action not in (ActionKind.DUMP_AND_EXIT, ActionKind.INJECT_FAULT):
                log.info("rank=%d %s ack ignored in state %s", info.rank, message.action.name, state.value)
            return
        if state is ControllerState.ROLLBACK and message.step != rec.repair_step:
            log.warning("rank=%d restored step %d, expected %d; ignoring", info.rank, message.step,
                        rec.repair_step)
            return
        if message.action is ActionKind.PAUSE:
            info.held_steps = tuple(message.held_steps)
            if info.state is not RankState.FAULTY:
                info.state = RankState.PAUSED
        elif message.action is ActionKind.ROLLBACK:
            info.state = RankState.RESTORED
        else:
            info.state = RankState.RESUMED
        rec.acked.add(info.rank)
        self._advance(recount=False)

    def _inject(self, message: InjectRequest) -> Reply:
        info = self._ranks.get(message.rank)
        if info is None or not info.alive or not info.participating:
            return Reply(False, f"rank {message.rank} is not registered and running")
        if self.state is not ControllerState.NORMAL:
            # Ranks obey actions in order; an injection in the middle of a recovery would
            # reach a rank that is waiting for ROLLBACK or RESUME, not at a step boundary.
            return Reply(False, f"the job is {self.state.value}, not NORMAL; inject when it trains")
        self._send(info.identity, Action(ActionKind.INJECT_FAULT, self._committed, reason=message.detail,
                                         fault=message.fault, round=self._recovery.round))
        log.info("rank=%d asked to inject %s", message.rank, message.fault.name)
        return Reply(True, f"rank {message.rank} will raise {message.fault.name} at its next step boundary")

    def _process_exit(self, message: ProcessExit) -> Reply:
        info = self._ranks.get(message.rank)
        if info is None:
            return Reply(False, f"rank {message.rank} never registered")
        if message.pid and info.pid and message.pid != info.pid:
            return Reply(True, f"pid {message.pid} is not rank {message.rank}'s current process")
        if not info.participating and message.returncode == 0:
            return Reply(True, "rank had finished")
        if self.state in (ControllerState.FAILED, ControllerState.DONE):
            return Reply(True, "job already ended")
        self._add_fault(message.rank, FaultKind.PROCESS_DIED, info.step,
                        f"process {info.pid} exited with code {message.returncode}", dead=True)
        return Reply(True, f"rank {message.rank} marked dead")

    def _local_process_exit(self, event: _ProcessExited) -> None:
        what = f"rank {event.rank} (pid {event.pid}) exited with code {event.returncode}"
        if self.state in (ControllerState.FAILED, ControllerState.DONE):
            return
        if self.state is ControllerState.STARTING and (event.final or event.rank not in self._ranks):
            self._fail(f"{what} before every rank registered")
            return
        if event.final:
            info = self._ranks.get(event.rank)
            if info is not None and not info.participating and event.returncode == 0:
                return
            step = info.step if info is not None else -1
            self._fail(f"{what} and will not be restarted, at step {step}")
            return
        self._process_exit(ProcessExit(rank=event.rank, returncode=event.returncode, pid=event.pid))

    def _device_event(self, event: Any) -> None:
        if isinstance(event, DeviceEvent):
            name = {DeviceStatus.FAULTY: "DeviceFaulty", DeviceStatus.RECOVERED: "DeviceRecovered",
                    DeviceStatus.FAILED: "DeviceFailed"}[event.status]
        else:
            name = type(event).__name__
        rank = getattr(event, "rank", None)
        if not isinstance(rank, int) or rank not in self._ranks:
            log.warning("device event %s for unknown rank %r ignored", name, rank)
            return
        if self.state in (ControllerState.FAILED, ControllerState.DONE):
            return
        if name == "DeviceFaulty":
            code, policy = getattr(event, "error_code", ""), getattr(event, "policy", "")
            self._add_fault(rank, FaultKind.DEVICE_RESET, self._ranks[rank].step,
                            f"device plugin: error {code or '?'} policy {policy or '?'}", dead=False,
                            device=True)
        elif name == "DeviceRecovered":
            fault = self._recovery.faults.get(rank)
            if fault is not None and fault.device_pending:
                fault.device_pending = False
                log.info("rank=%d device recovered", rank)
                self._advance()
        elif name == "DeviceFailed":
            reason = getattr(event, "reason", "")
            self._fail(f"device of rank {rank} could not be recovered ({reason or 'no reason given'}) "
                       f"at step {self._ranks[rank].step}")
        else:
            log.warning("unknown device event %s ignored", name)

    def _add_fault(self, rank: int, kind: FaultKind, step: int, detail: str, *, dead: bool,
                   device: bool = False) -> None:
        state = self.state
        if state in (ControllerState.FAILED, ControllerState.DONE):
            return
        info = self._ranks[rank]
        if state is ControllerState.STARTING:
            if dead:
                info.state = RankState.DEAD
            self._fail(f"rank {rank} {kind.name} before every rank registered: {detail}")
            return
        rec = self._recovery
        if state is ControllerState.NORMAL:
            rec.faults.clear()
            rec.started = time.monotonic()
        fault = rec.faults.get(rank)
        log.warning("rank=%d fault %s at step %d in state %s: %s", rank, kind.name, step, state.value, detail)
        if fault is None:
            fault = _Fault(kind, step, detail, device_pending=device, process_pending=dead)
            rec.faults[rank] = fault
            restart = True  # a new fault always (re)starts the recovery with the union of faults
        else:
            # The rank is already part of this recovery: record what else it now needs. The flow
            # restarts only if it was already past the point where that need is waited for.
            # A fault report while restoring or resuming means the rank cannot finish that
            # action: run the round again.
            restart = not dead and not device and state in (ControllerState.ROLLBACK,
                                                            ControllerState.RESUMING)
            if dead and not fault.process_pending:
                fault.process_pending = True
                fault.kind = kind if kind is FaultKind.PROCESS_DIED else fault.kind
                restart = True
            elif dead and kind is FaultKind.PROCESS_DIED:
                fault.kind = kind  # a hung rank's process is now known to be gone
            if device and not fault.device_pending:
                fault.device_pending = True
                fault.kind = FaultKind.DEVICE_RESET
                restart = restart or state not in (ControllerState.PAUSING, ControllerState.REPAIRING)
        if dead:
            info.state = RankState.DEAD
        elif info.state is not RankState.DEAD:
            info.state = RankState.FAULTY
        if restart:
            self._enter_pausing(fault.describe(rank))
        else:
            self._advance()

    def _enter_pausing(self, why: str) -> None:
        rec = self._recovery
        self._machine.transition(ControllerState.PAUSING, why)
        rec.round += 1
        rec.acked = set()
        rec.expected = None
        rec.repair_step = -1
        self._deadline = time.monotonic() + self._timeouts.pause
        self._broadcast(Action(ActionKind.PAUSE, self._committed, reason=why, round=rec.round))
        self._advance()

    def _advance(self, recount: bool = True) -> None:
        """Move forward through the recovery states as far as the registry allows.

        An acknowledgement changes nothing but ``acked``, so it passes ``recount=False``
        and costs O(1) until the last one arrives (O(N) per ack would be O(N²) per phase).
        """
        rec = self._recovery
        if recount or rec.expected is None:
            rec.expected = self._expected()
        while True:
            state = self.state
            if state in (ControllerState.PAUSING, ControllerState.ROLLBACK, ControllerState.RESUMING):
                if len(rec.acked) < len(rec.expected) or not rec.expected <= rec.acked:
                    return
            active = [info for info in self._ranks.values() if info.participating]
            if state is ControllerState.PAUSING:
                self._machine.transition(ControllerState.REPAIRING, "every live rank paused")
                self._deadline = time.monotonic() + self._timeouts.repair
            elif state is ControllerState.REPAIRING:
                # A live rank whose fault needs nothing external (UCE, COMMUNICATION, UNKNOWN)
                # is repaired as soon as it waits; devices and dead processes are waited for.
                if any(f.device_pending or f.process_pending for f in rec.faults.values()):
                    return
                if any(not info.alive for info in active):
                    return
                self._enter_rollback(active)
                if self.state is not ControllerState.ROLLBACK:
                    return
            elif state is ControllerState.ROLLBACK:
                self._machine.transition(ControllerState.RESUMING, f"every rank restored step {rec.repair_step}")
                rec.acked = set()
                rec.expected = self._expected()
                # COMMIT(repair step) is implied. Votes from before the rollback are void; a rank
                # that resumes may vote for the next step before the others acknowledged RESUME.
                self._committed = rec.repair_step
                self._votes.clear()
                for info in active:
                    info.finished = info.step = rec.repair_step
                self._deadline = time.monotonic() + self._timeouts.resume
                self._broadcast(Action(ActionKind.RESUME, rec.repair_step, endpoints=self._changed_endpoints(),
                                       round=rec.round))
            elif state is ControllerState.RESUMING:
                self._finish_recovery(active)
                return
            else:
                return

    def _expected(self) -> set[int]:
        """Ranks whose acknowledgement the current phase waits for."""
        if self.state is ControllerState.PAUSING:
            return {r for r, i in self._ranks.items() if i.alive and i.participating}
        return {r for r, i in self._ranks.items() if i.participating}

    def _enter_rollback(self, active: list[_Rank]) -> None:
        rec = self._recovery
        common = set(active[0].held_steps) if active else set()
        for info in active[1:]:
            common &= set(info.held_steps)
        if not common:
            held = "; ".join(f"rank {i.rank} holds {list(i.held_steps)}" for i in active)
            self._fail(f"no step is held by every rank, cannot roll back ({held}); "
                       f"faults: {self._fault_summary()}")
            return
        rec.repair_step = max(common)
        self._machine.transition(ControllerState.ROLLBACK, f"repair step {rec.repair_step}")
        rec.acked = set()
        rec.expected = self._expected()
        self._deadline = time.monotonic() + self._timeouts.rollback
        self._broadcast(Action(ActionKind.ROLLBACK, rec.repair_step, endpoints=self._changed_endpoints(),
                               round=rec.round))

    def _finish_recovery(self, active: list[_Rank]) -> None:
        rec = self._recovery
        self._machine.transition(ControllerState.NORMAL, f"every rank resumed from step {rec.repair_step}")
        self._deadline = float("inf")
        now = time.monotonic()
        for info in active:
            info.state, info.last_seen = RankState.RUNNING, now
        took = now - rec.started
        self._recoveries.append(took)
        phases: dict[str, float] = {}
        marks = [(state, at) for state, at in self._machine.history if at >= rec.started]
        for (state, at), (_, until) in zip(marks, marks[1:]):
            phases[state.value] = phases.get(state.value, 0.0) + (until - at)
        self._recovery_phases.append(phases)
        log.info("recovery %d done in %.3f s: %s; resumed after step %d", len(self._recoveries), took,
                 self._fault_summary(), rec.repair_step)
        rec.faults.clear()
        if not self._check_done():  # a rank may have finished right after its RESUME ack
            self._try_commit()  # ranks that resumed first may already have voted

    def _changed_endpoints(self) -> dict[int, str]:
        """Replica endpoints that differ from the start barrier's map (restarted ranks)."""
        return {r: info.replica_endpoint for r, info in self._ranks.items()
                if self._barrier_endpoints.get(r) != info.replica_endpoint}

    def _fault_summary(self) -> str:
        return "; ".join(f.describe(r) for r, f in sorted(self._recovery.faults.items())) or "none"

    def _fail(self, reason: str) -> None:
        if self.state in (ControllerState.FAILED, ControllerState.DONE):
            return
        self._machine.transition(ControllerState.FAILED, reason)
        self._failure = reason
        self._broadcast(Action(ActionKind.DUMP_AND_EXIT, self._committed, reason=reason,
                               round=self._recovery.round))
        self._result = JobResult(EXIT_FAILED, reason)
        log.error("job failed: %s; every live rank was told to dump and exit", reason)

    def _phase_timeout(self) -> None:
        state, rec = self.state, self._recovery
        active = [info for info in self._ranks.values() if info.participating]
        if state is ControllerState.STARTING:
            missing = [r for r in range(self._config.world_size) if r not in self._ranks]
            self._fail(f"start barrier timed out after {self._timeouts.register:g} s "
                       f"(timeouts.register): rank(s) {missing} never registered")
            return
        limit = {ControllerState.PAUSING: ("pause", self._timeouts.pause),
                 ControllerState.REPAIRING: ("repair", self._timeouts.repair),
                 ControllerState.ROLLBACK: ("rollback", self._timeouts.rollback),
                 ControllerState.RESUMING: ("resume", self._timeouts.resume)}.get(state)
        if limit is None:
            self._deadline = float("inf")
            return
        if state is ControllerState.REPAIRING:
            pending = [f"rank {r} ({'device not recovered' if f.device_pending else 'not re-registered'})"
                       for r, f in sorted(rec.faults.items()) if f.device_pending or f.process_pending]
        else:
            pending = [f"rank {i.rank}" for i in active if i.alive and i.rank not in rec.acked]
        self._fail(f"{state.value} timed out after {limit[1]:g} s (timeouts.{limit[0]}) at step "
                   f"{self._committed}: waiting for {', '.join(pending) or 'nothing'}; "
                   f"faults: {self._fault_summary()}")

    def _beat(self, now: float) -> None:
        if self.state is ControllerState.STARTING:
            # Registered ranks wait at the barrier; tell them the controller is alive.
            frame = encode(Heartbeat(-1, 0, self._committed))
            for info in self._ranks.values():
                self._send_frame(info.identity, frame)
            return
        self._broadcast(Heartbeat(-1, 0, self._committed))
        dead_after = self._timeouts.dead_after
        for info in list(self._ranks.values()):
            if self._result is not None:
                return
            if info.alive and info.participating and now - info.last_seen > dead_after:
                self._add_fault(info.rank, FaultKind.HANG, info.step,
                                f"no heartbeat for {now - info.last_seen:.2f} s "
                                f"(timeouts.dead_after={dead_after:g} s)", dead=True)

    def status(self) -> StatusReply:
        """The controller's view of the job (answer to StatusRequest).

        Not synchronized: call it from the thread running :meth:`serve` or after it returned;
        other threads and processes send a StatusRequest (``mindft.processor.request``).
        """
        now = time.monotonic()
        ranks = tuple(RankStatus(rank=i.rank, state=i.state.value, step=i.step,
                                 last_heartbeat_age=round(now - i.last_seen, 3), restarts=i.restarts,
                                 pid=i.pid, incarnation=i.incarnation,
                                 replica_endpoint=i.replica_endpoint)
                      for _, i in sorted(self._ranks.items()))
        reason = self._failure or (self._fault_summary() if self.state in _RECOVERY else "")
        return StatusReply(state=self.state.value, step=self._committed, ranks=ranks, reason=reason,
                           round=self._recovery.round)


_STOP = object()


@dataclass(frozen=True)
class _ProcessExited:
    """A process exit handed in by :meth:`Controller.on_process_exit`."""

    rank: int
    returncode: int
    pid: int
    final: bool


def main() -> int:
    """``python -m mindft.controller``: run a controller configured from the environment."""
    logging.basicConfig(level=os.environ.get("MINDFT_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        controller = Controller(load_config())
    except ConfigError as error:
        print(f"mindft controller: configuration error: {error}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    result = controller.serve()
    print(f"mindft controller: {result.reason}", flush=True)
    return result.exit_code


if __name__ == "__main__":
    # Run the copy in sys.modules so classes and loggers are mindft.controller's, not __main__'s.
    from mindft.controller import main as _main
    raise SystemExit(_main())
