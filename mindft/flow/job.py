"""The controller's rules as a plain object: ``Job.handle/device/process_exit/scheduler_lost/tick`` → effects.

    STARTING → NORMAL → PAUSING → REPAIRING → ROLLBACK → RESUMING → NORMAL
    any recovery state → PAUSING on a further fault (a new round, the union of faults)
    any non-terminal state → FAILED;  NORMAL → DONE

The job holds its recovery ladder (:class:`~mindft.flow.ladder.Ladder`), passing itself as the
ladder's :class:`~mindft.flow.ladder.Port`; a lost member's rules are :mod:`mindft.flow.lost`'s.

There is no per-step barrier: ranks report each finished step without waiting, and the
job broadcasts the slowest rank's progress when it rises. The step every rank rolls back
to is decided only when a fault happens, from the snapshots the ranks say they hold once
they have paused and settled (cf. MindIO's prelock, torchft's commit).
"""
from __future__ import annotations

import logging
import math
from typing import Optional

from mindft.config import Timeouts
from mindft.exitcodes import ExitCode
from mindft.flow import batches, elastic, hello, lost, standby
from mindft.flow.batches import ACK_WHAT
from mindft.flow.cadence import Budget, Tuner
from mindft.flow.elastic import ElasticRange
from mindft.flow.effects import (Broadcast, Effect, Fence, Finish, GiveNode, Peer, Resize, Send, SlowRank,
                                 Transition)
from mindft.flow.episode import Episode
from mindft.flow.goodput import Goodput
from mindft.flow.inputs import (DeviceFailed, DeviceFaulty, DeviceInput, DeviceRecovered, HoldRepairs, ProcessExited,
                                RollbackAll, SchedulerLost, StopJob, from_wire)
from mindft.flow.ladder import Ladder
from mindft.flow.ranks import RankRecord, RankState, RankTable
from mindft.flow.rejoin import Survivors
from mindft.flow.replicas import KeptSteps, ReplicaWatch
from mindft.flow.slow import SlowChange, SlowPolicy, SlowRanks
from mindft.flow.spares import HELLO_INTERVAL, Spares, given_away
from mindft.flow.status import job_status
from mindft.flow.states import RECOVERY_STATES, TERMINAL_STATES, Event, JobState, next_state
from mindft.protocol import (REPORT_SUFFIX, Ack, AckBatch, Action, ActionKind, AgentHello, Cadence, CostReport,
                             DeviceEvent, Done, FaultKind, FaultReport, Heartbeat, InjectRequest, JobView, Message,
                             NodeLost, Pace, Progress, ProcessExit, Register, RegisterAck, Replaced, ReplicaReport,
                             Reply, StatusReply, StatusRequest, StepBatch, StepReport, Superseded)

log = logging.getLogger(__name__)

_S = JobState


def held_after(progress: int, snapshot_every: int, keep: int = 2) -> frozenset[int]:
    """The snapshot steps a rank that finished ``progress`` steps holds once settled."""
    newest = progress - progress % snapshot_every
    return frozenset(s for s in range(newest, newest - keep * snapshot_every, -snapshot_every) if s >= 0)


class Job:
    """The whole flow for one job of ``world_size`` ranks; every method takes ``now`` (seconds).

    ``restart_scope``: "all" when the ranks' collectives cannot be repaired in place (a
    restarted process cannot rejoin the others' communicator), so that a fault that takes a
    process, or a rank blocked in a collective, restarts every worker; "rank" never; "auto"
    from the first rank that registers saying it uses such collectives.

    ``budget`` (None: the cadence stays ``snapshot_every``): the job chooses how often ranks
    snapshot from the costs they report (:meth:`_on_cost`), and announces each change.

    ``term``: this controller's (:mod:`mindft.flow.standby`; 0: the first controller's);
    ``candidates``: the nodes that stand by for it, in takeover order; ``standing_by``: a standby
    that commands nothing until half of the node agents said hello to it; ``supersedes``: the address
    of the controller it took over from, told so once it commands (:class:`Fence`).

    ``slow``: when a rank is flagged slow (:mod:`mindft.flow.slow`; the job only reports it).
    ``elastic``: MIN:MAX nodes: the job goes on with fewer nodes (:mod:`mindft.flow.elastic`).
    """

    def __init__(self, world_size: int, timeouts: Timeouts, now: float, snapshot_every: int = 1,
                 restart_scope: str = "auto", budget: Optional[Budget] = None, term: int = 0,
                 candidates: tuple[int, ...] = (), standing_by: bool = False, supersedes: str = "",
                 slow: SlowPolicy = SlowPolicy(), elastic: Optional[ElasticRange] = None) -> None:
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be >= 1, got {snapshot_every}")
        self.timeouts = timeouts
        self.snapshot_every = snapshot_every
        self.restart_scope = restart_scope
        self.restart_all = restart_scope == "all"
        self.ranks = RankTable(world_size)
        self.state = JobState.STARTING
        self.history: list[tuple[JobState, float]] = [(self.state, now)]
        self.result: Optional[Finish] = None
        self.deadline = now + timeouts.register  # of the phase the job waits in
        self._next_check = now  # when silent ranks are looked for next
        self._out: list[Effect] = []
        self.tuner = Tuner(snapshot_every, budget)  # the snapshot cadence every rank follows, and its costs
        self.replicas = ReplicaWatch()  # every rank's replica, from the node agents; LOST PROTECTION
        self.agents: dict[int, Peer] = {}  # rank → the link of the node agent that runs its process
        self.survivors = Survivors(world_size)  # what ranks and agents say while STARTING: is the job under way?
        self.spares = Spares(timeouts.dead_after)  # warm spare nodes, and the lost nodes given to them
        self.term, self.candidates, self.standing_by = term, candidates, standing_by
        # A standby tells the controller it replaced once it commands (and so does its successor).
        self.supersedes, self.next_fence = supersedes, now if supersedes and not standing_by else math.inf
        self.superseded: Optional[Superseded] = None  # a newer term commands the job: this controller stood down
        self.nproc = 0  # ranks per node, from the first node agent's hello
        self.goodput = Goodput(now)  # every second of the job's wall time, by bucket
        self.slow = SlowRanks(slow, now)  # every rank's own work per step, and the ranks flagged slow
        self.elastic, self.resized = elastic, None  # the resize that ends this job's world (flow.elastic)
        self.rebuild_reason, self.min_hello_term = "", 0  # of a job that rebuilds a resized world
        self.resized_links: frozenset[Peer] = frozenset()  # the agents told of that resize (flow.elastic)
        self.resizes: tuple[Resize, ...] = ()  # every world this job went through before its own
        self.trained_before = 0  # the step the world before this one had reached
        self.below_min: tuple[int, ...] = ()  # the lost nodes the job could not shrink past (said once)
        self.ladder = Ladder(self, self.ranks, timeouts, self.agents, self.replicas, self.survivors, self.tuner)

    @property
    def recovery(self) -> Episode:
        """The recovery under way, or the last one (the ladder's)."""
        return self.ladder.recovery

    @property
    def recoveries(self) -> list[float]:
        """How long each recovery took, seconds."""
        return self.ladder.recoveries

    # ---- inputs -----------------------------------------------------------------------------

    def handle(self, peer: Peer, message: Message, now: float) -> list[Effect]:
        """A message from a rank or a client."""
        kind = type(message)
        if (self.superseded is not None or self.resized is not None) and kind is not StatusRequest:
            return self._flush()  # it stood down, or its successor commands: it commands nothing any more
        if kind is StepReport:
            self._on_step(peer, message, now)
        elif kind is Heartbeat:
            self._on_heartbeat(peer, message, now)
        elif kind is Ack:
            record = self._sender(peer, message.rank, now, ACK_WHAT[message.action])
            if record is not None:
                self.ladder.ack(record, message, now)
        elif kind is AckBatch:
            batches.node_acks(self, peer, message, now)
        elif kind is StepBatch:
            batches.node_steps(self, peer, message, now)
        elif kind is FaultReport:
            record = self._sender(peer, message.rank, now, "fault report")
            if record is not None:
                self.ladder.add_fault(record, message.kind, message.step, message.detail, now, at=now - message.age)
        elif kind is Register:
            self._on_register(peer, message, now)
        elif kind is Done:
            self._on_done(peer, message, now)
        elif kind is StatusRequest:
            self.emit(Send(peer, self.status(now, message.request_id)))
        elif kind is InjectRequest:
            self.emit(Send(peer, self._inject(message)))
        elif kind is ProcessExit:
            ok, detail = self._process_exit(ProcessExited(message.rank, message.returncode, message.pid),
                                            now, will_restart=message.will_restart)
            self.emit(Send(peer, Reply(ok, detail, message.request_id)))
        elif kind is DeviceEvent:
            self._on_wire_device_event(peer, message, now)
        elif kind is CostReport:
            self._on_cost(peer, message, now)
        elif kind is Pace:
            record = self._sender(peer, message.rank, now, "pace")
            if record is not None and self.state is _S.NORMAL:
                self.slow.pace(record.rank, message.steps, message.seconds)
        elif kind is ReplicaReport:
            detail = self._on_replicas(message)
            self.emit(Send(peer, Reply(not detail, detail, message.request_id)))
        elif kind is NodeLost:
            given = self.spares.refuses(message)
            behind = "" if given is not None else elastic.left_behind(self, peer, message.node, now)
            if given is not None or behind:
                self.emit(Send(peer, Replaced(message.node, behind or given_away(given.node, given.number,
                                                                                given.reason), message.request_id)))
            else:
                ok, detail = lost.node_lost(self.ladder, message, now)
                self.emit(Send(peer, Reply(ok, detail, message.request_id)))
        elif kind is AgentHello:
            hello.agent_hello(self, peer, message, now)
        elif kind is Superseded:
            standby.stand_down(self, message)
        else:
            log.warning("dropped %s from peer %r: not addressed to the controller", kind.__name__, peer[:32])
        return self._flush()

    def device(self, event: DeviceInput, now: float) -> list[Effect]:
        """A device event (from the reset-file watcher)."""
        self._device(event, now)
        return self._flush()

    def _device(self, event: DeviceInput, now: float) -> None:
        if self.state in TERMINAL_STATES:
            return
        if isinstance(event, StopJob):
            self.ladder.fail(f"stop requested: {event.reason}", now)
            return
        if isinstance(event, HoldRepairs):
            self.ladder.hold(event.active, now)
            return
        if isinstance(event, RollbackAll):
            record = self.ranks.get(event.rank) or next(iter(sorted(self.ranks, key=lambda r: r.rank)), None)
            if record is not None and self.state is not _S.STARTING:
                self.ladder.add_fault(record, FaultKind.UNKNOWN, record.progress + 1, event.reason, now)
            return
        record = self.ranks.get(event.rank)
        if record is None:
            log.warning("device event %s for rank %d, which has not registered: ignored",
                        type(event).__name__, event.rank)
        elif isinstance(event, DeviceFaulty):
            self.ladder.add_fault(record, FaultKind.DEVICE_RESET, record.progress + 1,
                                  f"device plugin: error {event.error_code or '?'} policy {event.policy or '?'}",
                                  now, device=True)
            self.tell_agents()  # no agent may restart the rank's process on its own now
        elif isinstance(event, DeviceRecovered):
            self.ladder.device_recovered(event.rank, now)
        elif isinstance(event, DeviceFailed):
            self.ladder.fail(f"device of rank {event.rank} could not be recovered "
                             f"({event.reason or 'no reason given'})", now)

    def process_exit(self, event: ProcessExited, now: float, will_restart: bool = True) -> list[Effect]:
        """The launcher saw a rank's process exit; ``will_restart`` says whether a new one follows."""
        self._process_exit(event, now, will_restart)
        return self._flush()

    def scheduler_lost(self, event: SchedulerLost, now: float) -> list[Effect]:
        """Node 0's agent saw MindSpore's scheduler die while the ranks trained (see
        :func:`~mindft.flow.lost.scheduler_lost`)."""
        lost.scheduler_lost(self.ladder, event, now)
        return self._flush()

    def tick(self, now: float) -> list[Effect]:
        """Hang detection and phase deadlines due at ``now`` (no heartbeats: see :meth:`_on_heartbeat`)."""
        if now >= self.next_fence:
            self.next_fence = now + HELLO_INTERVAL
            self.emit(Fence(self.supersedes, self.term))
        if self.state in TERMINAL_STATES or self.superseded is not None or self.resized is not None:
            return self._flush()
        if now >= self._next_check:
            self._next_check = now + self.timeouts.heartbeat_interval
            if self.state is not _S.STARTING:
                for record in self.ranks.silent(now, self.timeouts.dead_after):
                    if self.state in TERMINAL_STATES:
                        break
                    lost.rank_silent(self.ladder, record, now)
            if self.spares.waiting:
                heard = {record.rank: record.last_seen for record in self.ranks}
                for adoption in self.spares.adopt(self.state, now, heard, self.timeouts.repair):
                    self.emit(GiveNode(adoption.node, adoption.peer, adoption.number, adoption.reason))
            if self.elastic is not None:
                elastic.resize_when_due(self, now)
        if self.resized is None and self.state is _S.NORMAL:
            for change in self.slow.due(now):
                self._slow_changed(change, now)
        lost.kill_late_leavers(self.ladder, now)
        if self.state not in TERMINAL_STATES and now >= self.deadline:
            self.ladder.phase_timeout(now)
        return self._flush()

    def next_wakeup(self) -> float:
        """When :meth:`tick` must be called next (inf once the job ended)."""
        if self.state in TERMINAL_STATES or self.superseded is not None or self.resized is not None:
            return self.next_fence
        slow_window = self.slow.window_end if self.state is _S.NORMAL else math.inf
        return min(self._next_check, self.deadline, self.next_fence, slow_window)

    def status(self, now: float, request_id: int = 0) -> StatusReply:
        """The job as ``mindft status`` shows it (:func:`mindft.flow.status.job_status`)."""
        return job_status(self, now, request_id)

    # ---- rank messages ----------------------------------------------------------------------

    def _on_heartbeat(self, peer: Peer, message: Heartbeat, now: float) -> None:
        # Any message from a rank proves it alive, so a rank heartbeats only after an interval in
        # which it sent, or heard, nothing else; the answer goes to it alone (never a broadcast
        # per beat), so a rank that hears nothing else still knows the controller is there.
        # A peer that is not a live registered incarnation gets no answer: silence makes it
        # reconnect and register again.
        if self._sender(peer, message.rank, now, "heartbeat") is not None and self.state not in TERMINAL_STATES:
            self.emit(Send(peer, Heartbeat(-1, 0, self.ranks.slowest)))

    def _sender(self, peer: Peer, rank: int, now: float, what: str) -> Optional[RankRecord]:
        record = self.ranks.get(rank)
        if record is None or record.peer != peer:
            log.warning("dropped %s for rank %d from peer %r: not its registered incarnation", what, rank, peer[:32])
            return None
        if not record.alive:
            return None
        record.last_seen = now
        return record

    def _on_step(self, peer: Peer, message: StepReport, now: float) -> None:
        record = self.ranks.get(message.rank)
        if record is None or peer not in (record.peer, record.peer + REPORT_SUFFIX) or not record.alive:
            return  # a stale incarnation's last reports, or noise: nothing to learn
        record.last_seen = now
        if message.round == self.recovery.round:  # else sent before it saw this round: its progress was reset since
            self.advanced(self.ranks.advance(record, message.step), now)

    def advanced(self, rose: bool, now: float) -> None:
        """The slowest rank's progress rose (``rose``): while training, every rank is told."""
        if rose and self.state is _S.NORMAL:
            self.goodput.progress(self.ranks.slowest, self.tuner.cost(), now)
            if self.tuner.retune_due:
                self._retune()  # before the Progress that lets ranks past the switch point
            self.emit(Broadcast(self.ranks.peers(), Progress(self.ranks.slowest)))

    def _on_register(self, peer: Peer, message: Register, now: float) -> None:
        rank, world = message.rank, self.ranks.world_size
        if not 0 <= rank < world:
            log.warning("dropped register from rank %d: outside 0..%d", rank, world - 1)
            return
        old = self.ranks.get(rank)
        if old is not None and message.incarnation < old.incarnation:
            log.warning("dropped register from rank %d incarnation %d: older than %d", rank,
                        message.incarnation, old.incarnation)
            return
        if old is not None and message.incarnation == old.incarnation and not old.alive:
            # A process declared dead (hung) or told to stop still talks: only a new incarnation
            # takes its place, or a restart of every worker would count it as restarted.
            log.warning("dropped register from rank %d incarnation %d: that process was declared %s",
                        rank, message.incarnation, old.state.value)
            return
        if old is not None and message.incarnation == old.incarnation and old.alive:
            # The same process reconnected (Paranoid Pirate retry): refresh and answer, no fault.
            self.ranks.rebind(old, peer)
            old.last_seen, old.pid = now, message.pid
            if self.state is not _S.STARTING:
                self.emit(Send(peer, self._register_ack()))
            return
        if message.collectives and self.restart_scope == "auto" and not self.restart_all:
            self.restart_all = True
            self.tell_agents()
            log.info("rank=%d uses collectives a restarted process cannot rejoin: a lost process restarts "
                     "every worker", rank)
        restarts = message.incarnation if old is None else old.restarts + (message.incarnation > old.incarnation)
        record = RankRecord(rank=rank, peer=peer, incarnation=message.incarnation, pid=message.pid,
                            replica_endpoint=message.replica_endpoint, held=tuple(message.held_steps),
                            last_seen=now, restarts=restarts,
                            progress=max(message.progress, max(message.held_steps, default=0)))
        self.ranks.add(record)
        log.info("rank=%d registered incarnation=%d pid=%d held=%s state=%s", rank, message.incarnation,
                 message.pid, list(message.held_steps), self.state.value)
        if self.state is _S.STARTING:
            self.survivors.registered(rank, message.progress)
            if self.survivors.under_way:
                hello.rejoin_when_heard(self, now)
            elif self.ranks.complete:
                self._start_training(now)
            return
        if self.state is _S.FAILED:
            self.emit(Send(peer, Action(ActionKind.DUMP_AND_EXIT, -1, reason=self.result.reason,
                                        round=self.recovery.round)))
            return
        if self.state is _S.DONE:
            self.emit(Send(peer, Action(ActionKind.FINISH, self.ranks.slowest, round=self.recovery.round)))
            return
        record.state = RankState.PAUSED  # a fresh process waits for ROLLBACK
        self.emit(Send(peer, self._register_ack()))
        lost.process_registered(self.ladder, record, old, message.incarnation, now)

    def view(self) -> JobView:
        """What the node agents are told of the job (:class:`~mindft.protocol.JobView`)."""
        reason = self.result.reason if self.result is not None else ""
        resetting = tuple(sorted(r for r, f in self.recovery.faults.items() if f.device_pending)) \
            if self.state in RECOVERY_STATES else ()
        unreached = tuple(r for r in range(self.ranks.world_size) if self._unreached(r)) \
            if self.state is _S.FAILED else ()
        return JobView(self.state, self.restart_all, self.ladder.dump_step, reason, resetting, self.ladder.verdict,
                       unreached, self.term, self.standby_addresses())

    def standby_addresses(self) -> tuple[str, ...]:
        known = self.spares.nodes
        return tuple(known[node].address if node in known else "" for node in self.candidates)

    def _unreached(self, rank: int) -> bool:
        """The job cannot tell ``rank`` to dump: it never registered (with this controller: one
        started again knows only the ranks that re-registered), or it is lost or dead."""
        record = self.ranks.get(rank)
        return record is None or record.state in (RankState.LOST, RankState.DEAD)

    def tell_agents(self) -> None:
        peers = tuple(dict.fromkeys((*self.agents.values(), *self.spares.waiting)))
        if peers:
            self.emit(Broadcast(peers, self.view()))

    def _register_ack(self) -> RegisterAck:
        endpoints = {r.rank: r.replica_endpoint for r in sorted(self.ranks, key=lambda r: r.rank)}
        return RegisterAck(world_size=self.ranks.world_size, endpoints=endpoints, state=self.state.value,
                           step=self.ranks.slowest, cadence=self.tuner.schedule.wire())

    def _start_training(self, now: float) -> None:
        self.move(Event.ALL_REGISTERED, f"all {self.ranks.world_size} ranks registered", now)
        self.ladder.remember_endpoints()
        self.deadline = math.inf
        for record in self.ranks:
            record.state, record.last_seen = RankState.RUNNING, now
        self.emit(Broadcast(self.ranks.peers(), self._register_ack()))

    def _on_done(self, peer: Peer, message: Done, now: float) -> None:
        record = self._sender(peer, message.rank, now, "done")
        if record is None or record.state is RankState.DONE:
            return
        self.ranks.advance(record, message.step)
        if self.state in RECOVERY_STATES and not (self.state is _S.RESUMING and record.state is RankState.RESUMED):
            return  # it finished before it saw this round's PAUSE: it will see it
        record.state = RankState.DONE
        log.info("rank=%d done at step %d", record.rank, message.step)
        self.check_done(now)

    def check_done(self, now: float) -> None:
        """The job ends, OK, if it trains and every rank is done (the ladder's port)."""
        if self.state is not _S.NORMAL or self.ranks.count(RankState.DONE) != len(self.ranks):
            return
        done = len(self.recoveries)
        reason = (f"all {self.ranks.world_size} ranks finished at step {self.ranks.slowest}; "
                  f"{done} recover{'y' if done == 1 else 'ies'}")
        self.emit(Broadcast(self.ranks.peers(), Action(ActionKind.FINISH, self.ranks.slowest,
                                                       round=self.recovery.round)))
        self.move(Event.ALL_DONE, reason, now)
        self.finish(ExitCode.OK, reason)

    def finish(self, code: ExitCode, reason: str) -> None:
        """The job ended (the ladder's port): its result goes out."""
        self.deadline = math.inf
        self.result = Finish(code, reason, self.ladder.dump_step)
        self.emit(self.result)

    def _inject(self, message: InjectRequest) -> Reply:
        record = self.ranks.get(message.rank)
        rid = message.request_id
        if record is None or not record.alive:
            return Reply(False, f"rank {message.rank} is not registered and running", rid)
        if self.state is not _S.NORMAL:
            return Reply(False, f"the job is {self.state.value}, not NORMAL; inject when it trains", rid)
        self.emit(Send(record.peer, Action(ActionKind.INJECT_FAULT, record.progress, reason=message.detail,
                                           fault=message.fault, round=self.recovery.round)))
        what = f"rank {message.rank} will raise {message.fault.name} at its next step boundary"
        if self.restart_all:
            # The peers cannot pause: they block in the collective the faulty rank never joins.
            wait = min(self.timeouts.pause, self.timeouts.stall)
            return Reply(True, f"{what}; its peers will block in their next collective, which this job cannot "
                               f"repair in place (a restarted process cannot rejoin it, as with MCCL on CPU), so "
                               f"after {wait:g} s (MINDFT_STALL_TIMEOUT) every worker restarts from the node "
                               f"agents' memory and rolls back to the newest snapshot every rank holds", rid)
        return Reply(True, f"{what}; every rank then rolls back in place to the newest snapshot every rank holds "
                           f"(no process restarts)", rid)

    def _process_exit(self, event: ProcessExited, now: float, will_restart: bool) -> tuple[bool, str]:
        record = self.ranks.get(event.rank)
        what = f"rank {event.rank} (pid {event.pid}) exited with code {event.returncode}"
        if self.state is _S.STARTING and self.survivors.under_way and will_restart:
            # The job is being rebuilt (a controller started again): its agent waits for a START.
            self.survivors.exited(event.rank)
            if record is not None and record.alive:
                record.state = RankState.DEAD
            hello.rejoin_when_heard(self, now)
            return True, f"rank {event.rank} starts with every worker once the job is rebuilt"
        if self.state is _S.STARTING and (record is None or not will_restart):
            self.ladder.fail(f"{what} before every rank registered", now, Event.FAULT)
            return True, "job failed: a rank exited before every rank registered"
        if record is None:
            return False, f"rank {event.rank} never registered"
        return lost.process_exited(self.ladder, record, event, will_restart, now)

    def _on_wire_device_event(self, peer: Peer, message: DeviceEvent, now: float) -> None:
        if not 0 <= message.rank < self.ranks.world_size:
            self.emit(Send(peer, Reply(False, f"no rank {message.rank}", message.request_id)))
            return
        self._device(from_wire(message), now)
        self.emit(Send(peer, Reply(True, f"{message.status.value} event for rank {message.rank}",
                                   message.request_id)))

    # ---- replicas and the snapshot cadence -----------------------------------------------------

    def _on_replicas(self, message: ReplicaReport) -> str:
        """A node agent's report of its ranks' replicas; what is wrong with it ("": nothing)."""
        committed = self.tuner.schedule.at_or_before(self.ranks.slowest)
        kept = KeptSteps(self.tuner.schedule.before(committed) if committed > 0 else committed, committed,
                         self.ranks.slowest)
        detail = self.replicas.report(message, self.ranks.world_size, kept if self.state is _S.NORMAL else None)
        if not detail and message.node >= 0 and self.tuner.report_replication(message.node, message.cpu_seconds):
            self._retune()
        return detail

    def _on_cost(self, peer: Peer, message: CostReport, now: float) -> None:
        record = self._sender(peer, message.rank, now, "cost report")
        if record is not None:
            self.tuner.report(record.rank, message.step_time, message.capture_time)
            self._retune()

    def _slow_changed(self, change: SlowChange, now: float) -> None:
        node = change.rank // self.nproc if self.nproc else -1
        reason = change.reason(node, self.slow.policy)
        self.emit(SlowRank(change.rank, node, change.slow, round(change.ratio, 3), reason))
        old = self.spares.nodes.get(node)
        moved = self.spares.replace_slow(node, now, self.timeouts.repair, reason) if change.slow and \
            self.slow.policy.to_spare else None
        if moved is not None:  # the spare adopts the node from its replicas; its agent stops its ranks
            self.emit(GiveNode(moved.node, moved.peer, moved.number, moved.reason))
            self.emit(Send(old.peer, Replaced(node, given_away(node, moved.number, moved.reason))))

    def _retune(self) -> None:
        if self.state is _S.NORMAL:
            wire = self.tuner.retune(self.ranks.slowest)
            if wire is not None:
                self.emit(Broadcast(self.ranks.peers(), Cadence(wire)))

    # ---- bookkeeping: the ladder's port ----------------------------------------------------------

    def move(self, event: Event, reason: str, now: float) -> None:
        """A transition of the table, told to the node agents."""
        source = self.state
        self.state = next_state(source, event)
        self.goodput.moved(self.state, self.ranks.slowest, now)
        self.slow.discard(now)  # a window measures training only: the one under way ends here
        self.history.append((self.state, now))
        del self.history[:-256]
        self.emit(Transition(source, self.state, reason))
        self.tell_agents()

    def emit(self, effect: Effect) -> None:
        """An effect goes out with the answer to the current input."""
        self._out.append(effect)

    def _flush(self) -> list[Effect]:
        out, self._out = self._out, []
        return out



