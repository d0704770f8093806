"""The job's controller: the ZeroMQ shell that runs :class:`mindft.flow.Job` with a real clock.

One thread (the one running :meth:`Controller.serve`) owns the socket and the job. Other
threads of the same process (the node agent, the reset watcher) hand inputs in through
:meth:`Controller.on_device_event`, :meth:`Controller.from_local_agent`,
:meth:`Controller.attach_agent` and :meth:`Controller.latest_status`, which queue them for that
thread. The job addresses its orders (:class:`~mindft.protocol.RankOrder`) and its view
(:class:`~mindft.protocol.JobView`) to the node agent that runs each rank: over the socket to
the agents of other nodes, by a call to the agent in this process (:data:`LOCAL_AGENT`).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Union

import zmq

from mindft.net import channel
from mindft.config import MindftConfig
from mindft.observe.events import (EventLog, FaultSeen, JobFinished, JobMoved, LadderDecision, NodeGiven, OrderSent,
                                   RankSlow, TookCommand, WorldResized)
from mindft.exitcodes import ExitCode
from mindft.flow.cadence import Budget
from mindft.flow.inputs import SchedulerLost
from mindft.flow.episode import DYING_GASP
from mindft.flow import (RECOVERY_STATES, Broadcast, DeviceInput, Effect, Fence, Finish, GiveNode, Job, JobState,
                         KillRank, Promoted, Resize, Send, SlowRank, StartRank, Transition, phase_times)
from mindft.flow.elastic import elastic_of, new_node, successor
from mindft.flow.slow import policy_of
from mindft.flow.standby import candidates
from mindft.protocol import AgentHello, Message
from mindft.net.keys import job_keys, start_authenticator
from mindft.observe.metrics import JobMetrics
from mindft.preflight import ato_failure_rate
from mindft.protocol import RELAY_SEPARATOR, ProtocolError, StatusReply, Superseded, decode, encode

log = logging.getLogger(__name__)

# Messages handled per poll wake-up before timers are checked again.
_BATCH = 10_000
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
# The job's address of the node agent in the controller's own process (no ZeroMQ identity is empty).
LOCAL_AGENT = b""


def job_budget(config: MindftConfig) -> Optional[Budget]:
    """The job's cadence budget: None when MINDFT_SNAPSHOT_EVERY fixes the cadence."""
    if config.snapshot_every is not None:
        return None
    return Budget(config.overhead_budget, config.max_replay_steps, ato_failure_rate(config.tft))


class Controller:
    """The job's coordinator (see the module docstring).

    The socket is bound in the constructor, so :attr:`endpoint` is known at once
    (``controller_port=0`` picks a free port). :attr:`metrics` (``metrics``, or a new
    :class:`~mindft.observe.metrics.JobMetrics`) counts the transitions it carries out and reads its status.
    :attr:`events` (``events``; set it before :meth:`serve` runs, None: no log) is the job's event
    log (:mod:`mindft.observe.events`): every transition, fault, ladder decision, order and the end.

    ``node``: the node it runs on; ``standby_term`` (a standby that takes over: the term it would
    command in; None: the first controller, term 0) makes it stand by until half of the node
    agents said hello to it (:mod:`mindft.flow.standby`); once in command it tells the controller
    it replaced, at ``supersedes``, so (:class:`~mindft.protocol.Superseded`).
    """

    def __init__(self, config: MindftConfig, clock: Callable[[], float] = time.monotonic,
                 metrics: Optional[JobMetrics] = None, events: Optional[EventLog] = None, node: int = 0,
                 standby_term: Optional[int] = None, supersedes: str = "") -> None:
        self._clock = clock
        self._wake_lock = threading.Lock()  # first: _close() needs it if the bind below fails
        self._local_agent: Optional[Callable[[Message], None]] = None
        self._keys = job_keys(config)
        self._context = zmq.Context()
        self._authenticator = start_authenticator(self._context, self._keys)
        port = "*" if config.controller_port == 0 else str(config.controller_port)
        try:
            self._socket = channel.router(self._context, self._keys, f"tcp://{config.controller_ip}:{port}")
        except zmq.ZMQError:
            self._close()
            raise
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._out = channel.RouterSender(self._socket)
        # Other threads queue inputs in _inbox and nudge the serving thread through this pipe.
        self._wake_in, wake_out = channel.pipe(self._context, "controller-wake")
        self._wake_out: Optional[zmq.Socket] = wake_out
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.node = node
        self.job = Job(config.world_size, config.timeouts, clock(), snapshot_every=config.snapshot_every or 1,
                       restart_scope=config.restart_scope, budget=job_budget(config),
                       term=standby_term or 0, candidates=candidates(config.standbys, node),
                       standing_by=standby_term is not None, supersedes=supersedes, slow=policy_of(config),
                       elastic=elastic_of(config))
        self._fence: Optional[zmq.Socket] = None  # to the controller it replaced
        self.result: Optional[Finish] = None
        self.metrics = metrics if metrics is not None else JobMetrics()
        self.metrics.watch(self.latest_status)
        self.events = events
        self._logged_faults: set[tuple[int, str, int, bool]] = set()  # of the current recovery, in the event log
        self._logged_rung: Optional[str] = None
        self.dropped_frames = 0
        self._stopped = False
        self._thread: Optional[threading.Thread] = None
        log.info("controller listening on %s for %d ranks (%s)", self.endpoint, config.world_size,
                 "insecure" if self._keys is None else "CurveZMQ")

    @property
    def state(self) -> JobState:
        """The job's state (read it from the serving thread, or after :meth:`serve` returned)."""
        return self.job.state

    @property
    def recovery_times(self) -> tuple[float, ...]:
        """Seconds from the first fault to every rank resumed, per completed recovery."""
        return tuple(self.job.recoveries)

    # ---- thread-safe inputs -------------------------------------------------------------

    def on_device_event(self, *events: DeviceInput) -> None:
        """Device events (``mindft.flow.DeviceFaulty`` etc.), from any thread; several are handled in one
        turn (a reset the watcher finds already over: the fault and its recovery)."""
        self._post(lambda now: [effect for event in events for effect in self.job.device(event, now)])

    def from_local_agent(self, message: Union[Message, SchedulerLost]) -> None:
        """A message of the node agent in this process (what other agents send on their link:
        an exit report; its answer reaches the agent like the orders), or the loss of MindSpore's
        scheduler, which runs only beside this controller; from any thread."""
        if isinstance(message, SchedulerLost):
            self._post(lambda now: self.job.scheduler_lost(message, now))
        else:
            self._post(lambda now: self.job.handle(LOCAL_AGENT, message, now))

    def attach_agent(self, node: int, ranks: tuple[int, ...], deliver: Callable[[Message], None]) -> None:
        """The node agent of this process runs ``ranks``: their orders and the job's view reach it
        as calls of ``deliver`` (on the serving thread: it must only queue them); from any thread."""
        self._local_agent = deliver
        self._post(lambda now: self.job.handle(LOCAL_AGENT, AgentHello(node, ranks), now))

    def latest_status(self, timeout: float = 5.0) -> StatusReply:
        """The job's status, computed by the serving thread; from any thread."""
        if self.result is not None or self._thread is None:
            return self.job.status(self._clock())
        answer: Future[StatusReply] = Future()
        self._post(answer)
        return answer.result(timeout)

    # ---- running ------------------------------------------------------------------------

    def start(self) -> threading.Thread:
        """Run :meth:`serve` on a background thread; :meth:`stop` or :meth:`join` it."""
        self._thread = threading.Thread(target=self.serve, name="mindft-controller", daemon=True)
        self._thread.start()
        return self._thread

    def join(self, timeout: Optional[float] = None) -> Optional[Finish]:
        """Wait for the thread started by :meth:`start`; its result, or None if still running."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.result

    def stop(self, timeout: float = 5.0) -> Optional[Finish]:
        """Ask :meth:`serve` to return (exit code 1 unless the job already ended) and wait."""
        self._post(_STOP)
        return self.join(timeout)

    def serve(self) -> Finish:
        """Run the flow until DONE, FAILED or :meth:`stop`; close the sockets; return the result."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        clock = self._clock
        try:
            while self.result is None:
                wait = max(0.0, self.job.next_wakeup() - clock())
                ready = dict(poller.poll(min(wait, 3600.0) * 1000.0))
                if self._socket in ready:
                    self._drain_socket()
                if self._wake_in in ready:
                    self._drain_inbox()
                if self.result is None:
                    self._apply(self.job.tick(clock()))
        except BaseException as error:
            self.result = Finish(ExitCode.FAILED, f"controller crashed: {error!r}")
            raise
        finally:
            self._close()
        if not self._stopped:
            log.info("controller finished: exit code %d: %s", self.result.exit_code, self.result.reason)
        return self.result

    def _post(self, item: Any) -> None:
        self._inbox.put(item)
        with self._wake_lock:
            if self._wake_out is not None:
                self._wake_out.send(b"", _NOBLOCK)

    def _drain_inbox(self) -> None:
        while True:
            try:
                self._wake_in.recv(_NOBLOCK)
            except zmq.Again:
                break
        now = self._clock()
        while self.result is None:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is _STOP:
                self.result = Finish(ExitCode.FAILED, "controller stopped before the job finished")
                self._stopped = True
            elif isinstance(item, Future):
                item.set_result(self.job.status(now))
            else:  # an input: a call of the job's that takes the time and returns effects
                self._apply(item(now))

    def _drain_socket(self) -> None:
        # Two recv() calls and one RCVMORE check per message rather than recv_multipart, which
        # costs twice as much per frame: at 16k ranks a phase brings 16k acknowledgements. The check
        # is the backend's get: zmq.Socket.getsockopt's Python layer doubles what it costs.
        sock = self._socket
        recv, more, clock = sock.recv, super(zmq.Socket, sock).get, self._clock
        for _ in range(_BATCH):
            try:
                peer = recv(_NOBLOCK)
            except zmq.Again:
                return
            frame = recv(_NOBLOCK)  # a ROUTER delivers the peer's identity and at least one frame, atomically
            if more(_RCVMORE):  # a relay's: [the rank's identity, its frame]
                rank, frame, parts = frame, recv(_NOBLOCK), 2
                while more(_RCVMORE):
                    recv(_NOBLOCK)
                    parts += 1
                if parts != 2 or not rank or peer[:1] == b"\x00" or RELAY_SEPARATOR in peer:
                    self._drop(peer, f"expected 1 frame, or a relayed rank's identity and 1 frame; got {parts}")
                    continue
                peer = peer + RELAY_SEPARATOR + rank
            try:
                message = decode(frame)
            except ProtocolError as error:
                self._drop(peer, str(error))
                continue
            self._apply(self.job.handle(peer, message, clock()))
            if self.result is not None:
                return

    def _apply(self, effects: list[Effect]) -> None:
        for effect in effects:
            kind = type(effect)
            if kind is Send:
                if effect.peer == LOCAL_AGENT:
                    self._deliver_locally(effect.message)
                else:
                    self._out.to(effect.peer, encode(effect.message))
            elif kind is Broadcast:
                peers = effect.peers
                if LOCAL_AGENT in peers:
                    self._deliver_locally(effect.message)
                    peers = tuple(p for p in peers if p != LOCAL_AGENT)
                self._out.to_all(peers, encode(effect.message))
            elif kind is Transition:
                if effect.source is effect.target:  # a further fault: a new round of the same recovery
                    log.info("controller state %s again, round %d (%s)", effect.target.value, self.job.recovery.round,
                             effect.reason)
                else:
                    log.info("controller state %s → %s (%s)", effect.source.value, effect.target.value, effect.reason)
                self.metrics.transition(self.job, effect)
                if self.events is not None:
                    self._log_transition(effect)
                if effect.target is JobState.NORMAL and effect.source is JobState.RESUMING:
                    rec = self.job.recovery
                    leave = rec.leave_seconds()
                    phases = {"detect": rec.detect_seconds(), **phase_times(self.job.history, rec.started),
                              **({"leave": leave} if leave is not None else {})}
                    log.info("recovery phases: %s", {k: round(v, 4) for k, v in phases.items()})
            elif kind is KillRank or kind is StartRank:
                order = dataclasses.replace(effect.order(), term=self.job.term)
                # A kill that answers a fault of that rank (a hang: restart it) needs attention; the
                # kills and starts of a restart of every worker are routine.
                routine = not (kind is KillRank and effect.restart)
                log.log(logging.INFO if routine else logging.WARNING, "rank=%d order %s: %s", effect.rank,
                        order.kind.value, effect.reason)
                if self.events is not None:
                    self.events.append(OrderSent(effect.rank, order.kind.value, effect.reason, order.pid,
                                                 kind is KillRank and effect.restart))
                if effect.agent is None:
                    log.warning("rank=%d: no node agent said it runs this rank; nobody carries out the %s order",
                                effect.rank, order.kind.value)
                elif effect.agent == LOCAL_AGENT:
                    self._deliver_locally(order)
                else:
                    self._out.to(effect.agent, encode(order))
            elif kind is GiveNode:
                log.warning("node %d given to a warm spare (adoption %d): %s", effect.node, effect.adoption,
                            effect.reason)
                if self.events is not None:
                    self.events.append(NodeGiven(effect.node, effect.adoption, effect.reason))
                self._out.to(effect.spare, encode(dataclasses.replace(effect.order(), term=self.job.term)))
            elif kind is SlowRank:
                log.log(logging.WARNING if effect.slow else logging.INFO, "%s", effect.reason)
                if self.events is not None:
                    self.events.append(RankSlow(effect.rank, effect.node, effect.slow, effect.ratio, effect.reason))
            elif kind is Fence:
                if self._fence is None:
                    self._fence = channel.dealer(self._context, self._keys, effect.address)
                try:
                    self._fence.send(encode(Superseded(effect.term, self.endpoint)), _NOBLOCK)
                except zmq.Again:  # it is not there yet: the frames queued already say the same
                    pass
            elif kind is Resize:
                self._resize(effect)
            elif kind is Promoted:
                log.warning("this standby controller on node %d takes command of the job (term %d): %s", self.node,
                            effect.term, effect.reason)
                if self.events is not None:
                    self.events.append(TookCommand(self.node, effect.term - 1, effect.term, effect.reason))
            elif kind is Finish:
                self.result = effect
                if self.events is not None:
                    seconds = {name: round(value, 3) for name, value in self.job.goodput.at(self._clock()).items()}
                    self.events.append(JobFinished(int(effect.exit_code), effect.reason, seconds))
                if effect.exit_code != ExitCode.OK:
                    log.error("job failed: %s", effect.reason)

    def _resize(self, resize: Resize) -> None:
        """Carry on with the job of the new world (:mod:`mindft.flow.elastic`): the node agents were told
        (:class:`~mindft.protocol.WorldResize`, sent just before); they say hello as their new nodes."""
        log.warning("elastic: %s; the job of %d rank(s) is rebuilt in term %d", resize.reason, resize.world_size,
                    resize.term)
        if self.events is not None:
            self.events.append(WorldResized(resize.members, resize.lost, resize.world_size, resize.term,
                                            self.job.ranks.slowest, resize.reason))
        self.job = successor(self.job, self._clock())
        self.node = new_node(resize.members, self.node)

    def _log_transition(self, effect: Transition) -> None:
        """The move, and what it tells of the recovery: faults not logged yet, a new rung of the ladder."""
        events, job = self.events, self.job
        assert events is not None
        recovery = job.recovery
        starts = effect.source not in RECOVERY_STATES and effect.target in RECOVERY_STATES
        events.append(JobMoved(effect.source.value, effect.target.value, effect.reason, recovery.round,
                               job.ranks.slowest, round(recovery.detect_seconds(), 4) if starts else -1.0))
        if effect.source not in RECOVERY_STATES:  # a new recovery (or none): nothing of it is logged yet
            self._logged_faults.clear()
            self._logged_rung = None
        if effect.target in RECOVERY_STATES:
            faults = list(recovery.faults.items())
            if recovery.scheduler is not None:
                faults.append((-1, recovery.scheduler))
            for rank, fault in faults:
                key = (rank, fault.kind.value, fault.step, fault.collateral)
                if key not in self._logged_faults:
                    self._logged_faults.add(key)
                    events.append(FaultSeen(rank, fault.kind.value, fault.step, fault.detail, fault.node,
                                            fault.collateral))
            rung = recovery.rung
            if rung != self._logged_rung:
                self._logged_rung = rung
                events.append(LadderDecision(rung, effect.reason))
        elif effect.target is JobState.FAILED:
            events.append(LadderDecision(DYING_GASP, effect.reason))

    def _deliver_locally(self, message: Message) -> None:
        if self._local_agent is not None:
            self._local_agent(message)

    def _drop(self, peer: bytes, reason: str) -> None:
        self.dropped_frames += 1
        log.warning("dropped a frame from peer %r: %s", peer[:32], reason)

    def _close(self) -> None:
        with self._wake_lock:
            wake_out, self._wake_out = getattr(self, "_wake_out", None), None
        for sock in (getattr(self, "_socket", None), getattr(self, "_wake_in", None), wake_out,
                     getattr(self, "_fence", None)):
            if sock is not None:
                sock.close(channel.ROUTER_LINGER_MS if sock is getattr(self, "_socket", None) else 0)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()
        if getattr(self, "events", None) is not None:
            self.events.close()  # the verdict is in it already
        while True:  # nobody will answer these any more
            try:
                item = self._inbox.get_nowait()
            except (queue.Empty, AttributeError):
                break
            if isinstance(item, Future):
                item.set_result(self.job.status(self._clock()))


_STOP = object()

