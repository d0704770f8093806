"""The recovery ladder, cheapest rung first: every rank pauses at a step boundary and rolls
back in place; if the job's collectives cannot be repaired in place (``restart_all``: MCCL
on CPU) and a fault takes a process, or a rank stays blocked (in a collective) past
``timeouts.stall``, every worker is killed and started again from the node agents' memory;
failing both, every rank dumps the same step and the job exits non-zero.

Deterministic failures are final: an exception from the training script (USER_ERROR), or a
rank's fault of the same kind in the same step as one the job already recovered from, fails
the job at once (every rank's dying gasp of one step), so a bug is retried at most once. The
step of a lost process or a hang is the one after the last step its rank reported, which may
lag the step it died in by one (the report dies with the process): for those, one step apart
is the same step.

MindSpore's scheduler is a member of the job too (:class:`~mindft.flow.inputs.SchedulerLost`,
from node 0's agent): without it no worker can join the cluster again, so its death restarts
every worker behind a new one (the second rung), a fault of the job (SCHEDULER_LOST) rather
than of a rank.

A node can be lost with its agent's memory (:class:`~mindft.protocol.NodeLost`, from the agent of
the node that replaces it): its ranks can then roll back only to the step of their replica on
the buddy node that the new agent restored, so the rollback step must be one that replica holds
and every other rank holds too; when none is, the job takes the dying-gasp rung at once, saying
why, rather than a recovery that would lose their state. The node agents report how far each
rank's replica got (:class:`~mindft.protocol.ReplicaReport`): a replica older than both steps
every rank keeps is LOST PROTECTION, logged once (and once when restored) and shown by status.

Node 0 lost takes the controller with it: the new one finds the job under way
(:mod:`mindft.flow.rejoin`) and restarts every worker, node 0's ranks from their replicas.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

from mindft.config import Timeouts
from mindft.exitcodes import ExitCode, describe_exit
from mindft.flow.cadence import Tuner
from mindft.flow.effects import Broadcast, Finish, KillRank, Peer, Send, StartRank
from mindft.flow.inputs import SchedulerLost
from mindft.flow.ranks import RankRecord, RankState, RankTable
from mindft.flow.rejoin import Survivors
from mindft.flow.replicas import ReplicaWatch, no_common_step, rank_list, replicas_share_a_step
from mindft.flow.states import RECOVERY_STATES, TERMINAL_STATES, Event, JobState
from mindft.protocol import Action, ActionKind, FaultKind, NodeLost, Progress

log = logging.getLogger(__name__)

_S = JobState
ACK_FOR = {_S.PAUSING: ActionKind.PAUSE, _S.ROLLBACK: ActionKind.ROLLBACK, _S.RESUMING: ActionKind.RESUME}
# The timeout (a field of :class:`~mindft.config.Timeouts`) that bounds each waiting state.
PHASE_TIMEOUTS = {_S.STARTING: "register", _S.PAUSING: "pause", _S.REPAIRING: "repair",
                  _S.ROLLBACK: "rollback", _S.RESUMING: "resume"}
SCHEDULER = -1  # the "rank" :meth:`Fault.describe` is given for the scheduler's fault: a member without a rank
# The ladder's rungs, as logs and metrics name them: every rank rolls back in place; every worker
# restarts from the node agents' memory; the job fails and every rank dumps one step.
IN_PLACE, RESTART_ALL, DYING_GASP = "in_place", "restart_all", "dying_gasp"
RUNGS = (IN_PLACE, RESTART_ALL, DYING_GASP)


@dataclass
class Fault:
    """Why one rank is part of the current recovery, and what it still waits for."""

    kind: FaultKind
    step: int
    detail: str
    device_pending: bool = False   # until the device plugin reports the chip recovered
    process_pending: bool = False  # until a new incarnation registers
    left_at: float = -1.0          # when the rank was told to leave its device or killed (-1: neither)
    exited: bool = False           # its process is gone (after leaving, it is started when the device is back)
    kill_ordered: bool = False     # KillRank was emitted for its process
    leaving: bool = False          # told to leave its chip (LEAVE_DEVICE): its exit ends the leave phase
    start_ordered: bool = False    # StartRank was emitted for the process that left
    collateral: bool = False       # no fault of its own: restarted with every worker
    node: int = -1                 # its node was lost (-1: not)
    # Until its new process registers after its node was lost: the steps it can roll back to
    # (its replica's, restored on the new node; empty: none). None: its node was not lost.
    replica: Optional[tuple[int, ...]] = None
    restore_from: str = ""  # the keeper its new process's agent restores its replica from first ("": none)

    def describe(self, rank: int) -> str:
        what = f"NODE LOST (node {self.node})" if self.node >= 0 else self.kind.name
        who = f"rank {rank} " if rank != SCHEDULER else ""
        return f"{who}{what} in step {self.step}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class Recovery:
    """The recovery in progress (or the last one)."""

    round: int = 0
    started: float = 0.0
    fault_at: float = 0.0  # when its first fault happened, by the best time the job has (see :meth:`begin`)
    leave_ordered: float = -1.0  # the first order to leave a chip (-1: none)
    left: float = -1.0  # the last exit of a rank told to leave its chip (-1: none yet)
    faults: dict[int, Fault] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)  # ranks whose acknowledgement the phase still needs
    repair_step: int = -1
    restart_all: bool = False  # this recovery restarts every worker (the ladder's second rung)
    lost: set[int] = field(default_factory=set)  # ranks lost with their node, until their new process registers
    known: Optional[frozenset[int]] = None  # the steps every rank that reported this round holds (None: none did)
    scheduler: Optional[Fault] = None  # MindSpore's scheduler was lost in this recovery (SCHEDULER_LOST)
    seen: dict[tuple[int, FaultKind], int] = field(default_factory=dict)  # (rank, kind) → step, of its faults

    def begin(self, now: float, fault_at: Optional[float] = None) -> None:
        """A fault while the job trained: a recovery starts, with no fault yet. ``fault_at``: when
        the fault happened (None: ``now``), as its reporter said (a rank's report, its age) or as
        the job last heard of the rank (a silent or dead process died after its last message)."""
        self.faults.clear()
        self.seen.clear()
        self.scheduler = None
        self.started = now
        self.fault_at = now if fault_at is None else min(fault_at, now)
        self.leave_ordered = self.left = -1.0
        self.restart_all = False

    def detect_seconds(self) -> float:
        """From its first fault to the recovery's start: how long the job took to learn of it."""
        return self.started - self.fault_at

    def leave_seconds(self) -> Optional[float]:
        """From the first order to leave a chip to the last exit of a rank told to (None: no rank
        was told to leave its chip, or none exited)."""
        return self.left - self.leave_ordered if self.leave_ordered >= 0 and self.left >= 0 else None

    @property
    def rung(self) -> str:
        """The rung this recovery is on while it runs (the job's failure is :data:`DYING_GASP`)."""
        return RESTART_ALL if self.restart_all else IN_PLACE

    def new_round(self) -> None:
        self.round += 1
        self.known = None

    def know(self, held: tuple[int, ...]) -> None:
        """A rank reported the steps it holds this round (kept as a running intersection)."""
        self.known = frozenset(held) if self.known is None else self.known & frozenset(held)


def retried(kind: FaultKind) -> bool:
    """Whether a fault of ``kind`` is worth a recovery: not an exception from the training script,
    which would raise again in the same step."""
    return kind is not FaultKind.USER_ERROR


class Ladder:
    """The recovery ladder's rules, part of :class:`~mindft.flow.job.Job`, which holds the state
    they read and move (declared below) and the bookkeeping they call: ``_move`` (a transition of
    the table), ``_emit`` (an effect going out), ``_check_done`` and ``_changed_endpoints``."""

    ranks: RankTable
    state: JobState
    timeouts: Timeouts
    recovery: Recovery
    restart_all: bool
    holding: bool
    deadline: float
    dump_step: int
    verdict: int
    result: Optional[Finish]
    recoveries: list[float]
    recovered: dict[tuple[int, FaultKind], int]  # (rank, kind) → step of the last such fault a recovery repaired
    agents: dict[int, Peer]
    tuner: Tuner
    replicas: ReplicaWatch
    survivors: Survivors

    # ---- the recovery -----------------------------------------------------------------------

    def _add_fault(self, record: RankRecord, kind: FaultKind, step: int, detail: str, now: float, *,
                   dead: bool = False, device: bool = False, exited: bool = False,
                   at: Optional[float] = None) -> None:
        """``at``: when the fault happened, if known before ``now`` (see :meth:`Recovery.begin`)."""
        state, rank = self.state, record.rank
        if state in TERMINAL_STATES:
            return
        if dead:
            record.state = RankState.DEAD
        elif record.alive:
            record.state = RankState.FAULTY
        if state is _S.STARTING:
            if self.survivors.under_way:  # every worker restarts once the job is rebuilt: nothing more to do
                log.info("rank=%d %s while the job is rebuilt (%s)", rank, kind.name, detail)
                return
            self._fail(f"rank {rank} {kind.name} before every rank registered: {detail}", now, Event.FAULT)
            return
        if not retried(kind):
            self._fail(f"rank {rank} raised an exception from the training script in step {step}, not a device "
                       f"fault: {detail}", now, verdict=ExitCode.FAILED)
            return
        if self._again(rank, kind, step):
            self._fail(f"rank {rank} {kind.name} in step {step} again after the job recovered from it: a "
                       f"deterministic failure, not retried ({detail})", now, verdict=ExitCode.FAILED)
            return
        rec = self.recovery
        if state is _S.NORMAL:
            rec.begin(now, at)
        log.warning("rank=%d fault %s in step %d in state %s: %s", rank, kind.name, step, state.value, detail)
        fault = rec.faults.get(rank)
        if fault is None:
            rec.faults[rank] = fault = Fault(kind, step, detail, device_pending=device, process_pending=dead,
                                             exited=exited)
            rec.seen[(rank, kind)] = step
            restart = True  # a new fault always (re)starts the recovery with the union of faults
        elif fault.collateral:
            # Stopped only so that every worker restarts, it now has a fault of its own; what that
            # restart still waits for of it (its exit, its new process, its replica) stays.
            fault.kind, fault.step, fault.detail, fault.collateral = kind, step, detail, False
            fault.device_pending, fault.process_pending = fault.device_pending or device, fault.process_pending or dead
            fault.exited = fault.exited or exited
            rec.seen[(rank, kind)] = step
            restart = True
        else:
            fault.exited = fault.exited or exited
            # Already part of this recovery: record what else it needs; start a new round only
            # if the flow was already past the point where that need is waited for.
            restart = not dead and not device and state in (_S.ROLLBACK, _S.RESUMING)
            if dead:
                restart = restart or not fault.process_pending
                fault.process_pending = True
                if kind is FaultKind.PROCESS_DIED or fault.kind is not FaultKind.DEVICE_RESET:
                    fault.kind = kind
            if device and not fault.device_pending:
                fault.device_pending = True
                fault.kind = FaultKind.DEVICE_RESET
                # A chip reset takes the process: where one process cannot rejoin, every worker restarts.
                restart = restart or state not in (_S.PAUSING, _S.REPAIRING) or (self.restart_all
                                                                                  and not rec.restart_all)
        if not restart:
            self._advance(now)
        elif self.restart_all and (dead or device or rec.restart_all):
            self._restart_every_worker(fault.describe(rank), now)
        else:
            self._enter_pausing(fault.describe(rank), now)

    def _again(self, rank: int, kind: FaultKind, step: int) -> bool:
        """Whether ``rank`` failed this way in this step before, and the job recovered from it (a
        chip reset is the device plugin's to judge)."""
        before = self.recovered.get((rank, kind))
        if before is None or kind is FaultKind.DEVICE_RESET:
            return False
        return abs(step - before) <= (1 if kind in (FaultKind.PROCESS_DIED, FaultKind.HANG) else 0)

    def _enter_pausing(self, why: str, now: float) -> None:
        rec = self.recovery
        self._move(Event.FAULT, why, now)
        rec.new_round()
        rec.waiting = self._answering()
        rec.repair_step = -1
        # A rank blocked in a collective never pauses: past timeouts.stall every worker restarts.
        self.deadline = now + (min(self.timeouts.pause, self.timeouts.stall) if self.restart_all
                               else self.timeouts.pause)
        self._emit(Broadcast(self.ranks.peers(), Action(ActionKind.PAUSE, self.ranks.slowest, reason=why,
                                                        round=rec.round)))
        self._advance(now)

    def _answering(self) -> set[int]:
        """The ranks a new round waits for: every live rank but those told to leave their device
        or killed, which count as gone (their exit, or the kill after ``timeouts.leave``, follows)."""
        faults = self.recovery.faults
        return {r.rank for r in self.ranks if r.alive and not (r.rank in faults and faults[r.rank].left_at >= 0)}

    def _restart_every_worker(self, why: str, now: float, event: Event = Event.FAULT) -> None:
        """The second rung: kill every process (their snapshots stay in the node agents' memory),
        start them all again once every one exited and every device is back, roll back."""
        rec = self.recovery
        self._move(event, f"{why}; restarting every worker from the node agents' memory", now)
        rec.new_round()
        rec.restart_all = True
        rec.waiting = set()
        rec.repair_step = -1
        for record in sorted(self.ranks, key=lambda r: r.rank):
            fault = rec.faults.get(record.rank)
            if fault is None:
                fault = rec.faults[record.rank] = Fault(FaultKind.UNKNOWN, record.progress + 1, "", collateral=True)
            # A process started for the previous round that has not registered yet joined the
            # cluster being given up: it is stopped too (pid 0: the job does not know its pid).
            starting = (fault.start_ordered and fault.process_pending
                        and record.state in (RankState.DEAD, RankState.OFF_DEVICE))
            fault.process_pending, fault.start_ordered = True, False
            if fault.left_at < 0:
                fault.left_at = now
            if record.alive or starting:
                self._emit(KillRank(record.rank, record.pid if record.alive else 0, f"every worker restarts: {why}",
                                    restart=False, agent=self.agents.get(record.rank)))
                record.state, fault.exited, fault.kill_ordered = RankState.DEAD, False, True
        self.deadline = now + self.timeouts.repair
        self._advance(now)

    def _rejoin(self, now: float) -> None:
        """This controller was started again while the job was under way (:mod:`mindft.flow.rejoin`),
        and every rank's agent has said what it runs and holds: every worker restarts from its
        agent's memory (MindSpore's scheduler went with node 0, so no worker can go on in its
        cluster), the lost node's ranks from their replicas, which bound the rollback step as for
        :meth:`_node_lost`. A rank that never registered with this controller is known by what its
        agent said: a process to kill (pid 0 in the order: the job cannot address it), or none."""
        rec, survivors = self.recovery, self.survivors
        rec.begin(now)
        lost = survivors.lost()
        for rank, said in survivors.agents.items():
            if self.ranks.get(rank) is None:
                self.ranks.add(RankRecord(rank=rank, peer=b"", incarnation=said.incarnation, pid=said.pid,
                                          replica_endpoint="", held=(), last_seen=now, state=RankState.DEAD,
                                          progress=max(said.newest, 0)))
        step = max(r.progress for r in self.ranks) + 1  # the step the job was in, as far as anyone says
        for rank, said in sorted(survivors.agents.items()):
            record = self.ranks.get(rank)
            fault = rec.faults[rank] = Fault(FaultKind.UNKNOWN, step, "", collateral=True)
            if not record.alive:
                # A process the job never heard from is stopped like one started for a recovery.
                fault.start_ordered = fault.process_pending = said.pid > 0
                fault.exited = said.pid == 0
            if rank in lost:
                replica = lost[rank]
                fault.kind, fault.collateral, fault.node = FaultKind.PROCESS_DIED, False, said.node
                fault.replica = (replica.step,) if replica is not None else ()
                fault.restore_from = replica.keeper if replica is not None else ""
                fault.detail = (f"node {said.node} lost with the controller; "
                                + (f"its replica of step {replica.step} is on node {replica.node}" if replica
                                   else "no node keeps a replica of it"))
                log.warning("rank=%d NODE LOST: %s", rank, fault.detail)
                rec.lost.add(rank)
        nodes = ", ".join(map(str, sorted({survivors.agents[r].node for r in lost})))
        why = "the controller started again while the job was under way" + (
            f" (node {nodes} lost with {rank_list(sorted(lost))})" if lost else "")
        self._restart_every_worker(why, now, Event.REJOIN)

    def _scheduler_lost(self, event: SchedulerLost, now: float) -> None:
        """MindSpore's scheduler died while the ranks trained: every worker restarts behind a new
        one (node 0's agent starts it before the first of them), or, when its agent used up its
        restarts or the job had not started, the job fails with dying gasps."""
        what = (f"MindSpore's scheduler, pid {event.pid}, {describe_exit(event.returncode)}"
                + (f"; its log: {event.cause}" if event.cause else ""))
        state = self.state
        if state in TERMINAL_STATES:
            log.info("%s after the job ended (%s)", what, state.value)
            return
        if state is _S.STARTING:
            self._fail(f"{what}, before every rank registered", now, Event.FAULT)
            return
        if not event.will_restart:
            self._fail(f"{what}; no new scheduler: node 0's agent used all its restarts (--max-restarts)", now)
            return
        rec = self.recovery
        if state is _S.NORMAL:
            rec.begin(now)
        log.warning("fault SCHEDULER_LOST in step %d in state %s: %s", self.ranks.slowest + 1, state.value, what)
        rec.scheduler = Fault(FaultKind.SCHEDULER_LOST, self.ranks.slowest + 1, what)
        self._restart_every_worker(rec.scheduler.describe(SCHEDULER), now)

    def _advance(self, now: float) -> None:
        """Move forward through the recovery states as far as the rank table allows."""
        rec = self.recovery
        while self.state in RECOVERY_STATES:
            state = self.state
            if state in ACK_FOR and rec.waiting:
                return
            if state is _S.PAUSING:
                self._move(Event.ALL_PAUSED, "every live rank paused", now)
                self.deadline = now + self.timeouts.repair
            elif state is _S.REPAIRING:
                # A live rank whose fault needs nothing external (UCE, COMMUNICATION, UNKNOWN)
                # is repaired as soon as it waits; devices and lost processes are waited for.
                # Every live rank is paused here: a rank on a chip being reset (also one that
                # faulted during this phase) leaves it now.
                self._leave_devices(now)
                if rec.restart_all:
                    self._start_every_worker_if_ready()
                if self._replicas_fall_short(now):
                    return
                if self.holding or any(f.device_pending or f.process_pending for f in rec.faults.values()):
                    return
                if any(not r.alive for r in self.ranks):
                    return
                step = self._common_step(exact=True)
                if step < 0:
                    self._fail("no step is held by every rank, cannot roll back ("
                               + "; ".join(f"rank {r.rank} holds {list(r.held)}" for r in self.ranks) + ")", now)
                    return
                rec.repair_step = step
                self._move(Event.REPAIRED, f"every rank holds step {step}", now)
                rec.waiting = {r.rank for r in self.ranks}
                self.deadline = now + self.timeouts.rollback
                self._emit(Broadcast(self.ranks.peers(), Action(ActionKind.ROLLBACK, step,
                                                                endpoints=self._changed_endpoints(),
                                                                round=rec.round)))
            elif state is _S.ROLLBACK:
                self._move(Event.ALL_RESTORED, f"every rank restored step {rec.repair_step}", now)
                rec.waiting = {r.rank for r in self.ranks}
                self.ranks.reset_progress(rec.repair_step)
                self.deadline = now + self.timeouts.resume
                self._emit(Broadcast(self.ranks.peers(), Action(ActionKind.RESUME, rec.repair_step,
                                                                endpoints=self._changed_endpoints(),
                                                                round=rec.round)))
            else:  # RESUMING, every rank acknowledged
                self._finish_recovery(now)

    def _leave_devices(self, now: float) -> None:
        """The device plugin resets a chip only once no process uses it: ranks on a chip being
        reset leave it now that their snapshots are settled (they keep them with the node agent)."""
        for rank, fault in sorted(self.recovery.faults.items()):
            record = self.ranks.get(rank)
            if fault.device_pending and fault.left_at < 0 and record is not None and record.alive:
                fault.left_at, fault.process_pending, fault.leaving = now, True, True
                if self.recovery.leave_ordered < 0:
                    self.recovery.leave_ordered = now
                self._emit(Send(record.peer, Action(ActionKind.LEAVE_DEVICE, record.progress,
                                                    reason=f"device reset: {fault.detail}",
                                                    round=self.recovery.round)))

    def _stopped(self, rank: int, fault: Fault, now: float) -> None:
        """A rank told to leave its chip or killed has exited: start it if ready."""
        if fault.leaving:
            self.recovery.left = now
        self._start_if_ready(rank, fault)

    def _start_if_ready(self, rank: int, fault: Fault) -> None:
        """Start a rank that left its device once the device is back (with every worker when
        every worker restarts)."""
        if self.recovery.restart_all:
            self._start_every_worker_if_ready()
        elif fault.left_at >= 0 and fault.exited and not fault.device_pending and not fault.start_ordered:
            fault.start_ordered = True
            self._emit(StartRank(rank, "its device was reset and is back", self.agents.get(rank), self._pid(rank),
                                 fault.restore_from))

    def _start_every_worker_if_ready(self) -> None:
        """Start every stopped worker together once every one exited and every device is back."""
        stopped = {r: f for r, f in self.recovery.faults.items() if f.left_at >= 0}
        if self.holding or not all(f.exited and not f.device_pending for f in stopped.values()):
            return
        for number, waiting in sorted(stopped.items()):
            if not waiting.start_ordered:
                waiting.start_ordered = True
                self._emit(StartRank(number, "every worker restarts from the node agents' memory"
                                     + (f" (this one from its replica at {waiting.restore_from})"
                                        if waiting.restore_from else ""),
                                     self.agents.get(number), self._pid(number), waiting.restore_from))

    def _pid(self, rank: int) -> int:
        record = self.ranks.get(rank)
        return record.pid if record is not None else 0

    def _finish_recovery(self, now: float) -> None:
        rec = self.recovery
        summary = self._fault_summary()
        self._move(Event.ALL_RESUMED, f"every rank resumed after step {rec.repair_step}", now)
        self.deadline = math.inf
        for record in self.ranks:
            record.last_seen = now
            if record.state is not RankState.DONE:  # resumed ranks may have finished already
                record.state = RankState.RUNNING
        self.recoveries.append(now - rec.started)
        self.recovered.update(rec.seen)
        log.info("recovery %d done in %.3f s: %s; resumed after step %d", len(self.recoveries),
                 now - rec.started, summary, rec.repair_step)
        rec.faults.clear()
        rec.scheduler = None
        # Resumed ranks reported steps meanwhile; one waiting at its window must hear of them
        # (RESUME told every rank the repair step: nothing to say if no rank got further).
        if self.ranks.slowest > rec.repair_step:
            self._emit(Broadcast(self.ranks.peers(), Progress(self.ranks.slowest)))
        self._check_done(now)

    def _common_step(self, exact: bool) -> int:
        """The newest step every rank holds (-1: none).

        ``exact`` uses only what the ranks reported this round; otherwise a rank that did not
        report is assumed to hold what its progress implies (so is every rank once training
        resumed: what they reported in the last round is stale).
        """
        common: Optional[frozenset[int]] = None
        recovering = self.state in RECOVERY_STATES
        for record in self.ranks:
            if record.state is RankState.LOST:
                continue  # neither a process nor an agent's memory to dump from (it rolls back only when back)
            if exact or (recovering and record.held_round == self.recovery.round):
                held = frozenset(record.held)
            else:
                held = self.tuner.schedule.held_after(record.progress)
            common = held if common is None else common & held
        return max(common) if common else -1

    def _node_lost(self, message: NodeLost, now: float) -> tuple[bool, str]:
        """A node and its agent's memory are gone (:class:`NodeLost`, from the agent that replaces it):
        its ranks can roll back only to the replica steps the new agent restored."""
        world, node = self.ranks.world_size, message.node
        if len(message.ranks) != len(message.steps) or not message.ranks:
            return False, "ranks and steps must be non-empty and of the same length"
        bad = next((r for r in (*message.ranks, *message.replicas_of) if not 0 <= r < world), None)
        if bad is not None:
            return False, f"rank {bad} is outside 0..{world - 1}"
        self.replicas.node_lost(node, message.replicas_of, self.state in TERMINAL_STATES)
        if self.state in TERMINAL_STATES:
            return True, f"the job already ended ({self.state.value})"
        if self.state is _S.STARTING:
            return True, "the job has not started: nothing to recover"
        rec = self.recovery
        if self.state is _S.NORMAL:  # the node died after the last message the job had from its ranks
            rec.begin(now, min((r.last_seen for r in map(self.ranks.get, message.ranks) if r is not None),
                               default=now))
        restart = self.state in (_S.ROLLBACK, _S.RESUMING)
        for rank, step in zip(message.ranks, message.steps):
            record = self.ranks.get(rank)
            if record is None:
                continue
            replica = (step,) if step >= 0 else ()
            reported = self.replicas.step(rank)
            detail = (f"node {node} lost" + (f": {message.reason}" if message.reason else "") + "; "
                      + (f"its new node restored its replica of step {step}" if step >= 0
                         else "no replica of it could be restored")
                      + (f" (last reported replicated: step {reported})" if reported >= 0 and reported != step else ""))
            log.warning("rank=%d NODE LOST in step %d in state %s: %s", rank, record.progress + 1, self.state.value,
                        detail)
            record.state = RankState.LOST  # record.held stays what it last said: its new process registers anew
            fault = rec.faults.get(rank)
            if fault is None:
                fault = rec.faults[rank] = Fault(FaultKind.PROCESS_DIED, record.progress + 1, detail)
                restart = True
            else:  # already waited for as a new process (also when stopped only so every worker restarts)
                restart = restart or not fault.process_pending
                fault.kind, fault.detail, fault.collateral = FaultKind.PROCESS_DIED, detail, False
            fault.node, fault.replica = node, replica
            rec.lost.add(rank)
            # Its process went with the node; its device too (the new node has its own).
            fault.process_pending, fault.exited, fault.device_pending, fault.kill_ordered = True, True, False, False
            if not rec.restart_all:
                fault.left_at, fault.start_ordered = -1.0, False  # the new node's agent starts it
            self.replicas.recovering(rank)
        why = f"node {node} lost with rank(s) {', '.join(map(str, message.ranks))}"
        # Before anything is paused for it (a new round makes the others' steps unknown). Workers
        # that restart together may be blocked in a collective with the lost ranks: they are
        # stopped first, and their agents write their dying-gasp checkpoints from memory.
        if self.restart_all or not self._replicas_fall_short(now, others=not restart):
            if not restart:
                self._advance(now)
            elif self.restart_all:
                self._restart_every_worker(why, now)
            else:
                self._enter_pausing(why, now)
        if self.state is _S.FAILED:
            return True, f"the job failed: {self.result.reason}"
        return True, f"{why}: they roll back to a step their replicas hold once their new processes register"

    def _replicas_fall_short(self, now: float, others: bool = True) -> bool:
        """True, and the job failed, when no step can be common: a rank whose node was lost can
        roll back only to its replica's step, and these steps, with those of the other ranks known
        this round (``others``), share none. A rank not known yet could only narrow them, so the
        job takes every rank's dying-gasp checkpoint now rather than restart anything, and never a
        recovery that would lose the lost ranks' state. O(lost ranks): the others' steps are kept
        as a running intersection (:meth:`Recovery.know`)."""
        rec = self.recovery
        lost = {r: rec.faults[r].replica or () for r in rec.lost}
        if replicas_share_a_step(lost, rec.known if others else None):
            return False
        known = [(r.rank, r.held) for r in self.ranks if others and r.rank not in lost and r.held_round == rec.round]
        self._fail(no_common_step(lost, (rec.faults[r].node for r in lost), known), now)
        return True

    def _fault_summary(self) -> str:
        rec = self.recovery
        scheduler = [rec.scheduler.describe(SCHEDULER)] if rec.scheduler is not None else []
        return "; ".join(scheduler + [f.describe(r) for r, f in sorted(rec.faults.items()) if not f.collateral]) \
            or "none"

    def _phase_timeout(self, now: float) -> None:
        state, rec = self.state, self.recovery
        name = PHASE_TIMEOUTS.get(state)
        if name is None:
            self.deadline = math.inf
            return
        if state is _S.PAUSING and self.restart_all:
            stalled = ", ".join(f"rank {r}" for r in sorted(rec.waiting))
            self._restart_every_worker(f"{stalled} did not pause within {self.timeouts.stall:g} s "
                                       f"(timeouts.stall): blocked in a collective", now)
            return
        limit = getattr(self.timeouts, name)
        self._fail(f"{state.value} timed out after {limit:g} s (timeouts.{name}): waiting for "
                   f"{self.waiting_for() or 'nothing'}", now, Event.TIMEOUT)

    def waiting_for(self) -> str:
        """Who the current phase waits for, and why ("": nobody, or no phase waits)."""
        state, rec = self.state, self.recovery
        if state is _S.STARTING:
            unheard = self.survivors.unheard()
            if self.survivors.under_way and unheard:
                return f"the node agents of rank(s) {unheard} (the job was under way: this controller started again)"
            missing = self.ranks.missing()
            return f"rank(s) {missing} (not registered)" if missing else ""
        if state is _S.REPAIRING:
            return ", ".join(f"rank {r} ({self._repair_wait(f)})" for r, f in sorted(rec.faults.items())
                             if f.device_pending or f.process_pending)
        if state in ACK_FOR:
            return ", ".join(f"rank {r}" for r in sorted(rec.waiting))
        return ""

    @staticmethod
    def _repair_wait(fault: Fault) -> str:
        """What a repair waits for of one rank, in the words of what is happening."""
        if fault.device_pending:
            return "its chip is being reset"
        if fault.node >= 0:
            return f"node {fault.node} was lost; its new process has not registered"
        if fault.kill_ordered and not fault.exited:
            return "its process is being stopped"
        if fault.start_ordered:
            return "its new process is starting: importing, joining MindSpore's cluster, restoring"
        return "its process is gone; a new one has not registered"

    def _fail(self, reason: str, now: float, event: Event = Event.UNRECOVERABLE, verdict: int = -1) -> None:
        """The job fails: every rank dumps one step. ``verdict``: the job's exit code whatever the
        ranks' (-1: from theirs), for a deterministic failure, which would fail the same way again:
        1 as a script's uncaught exception, though the dumps were written.

        Where a rank may be blocked in a collective with a rank that is gone (``restart_all``) it
        obeys no order: every live worker is stopped instead, and its node agent writes its dying
        gasp from memory (the same snapshot the rank would write)."""
        if self.state in TERMINAL_STATES:
            return
        # Before every rank registered, what each said it holds is all there is to go by.
        step = self.dump_step = self._common_step(exact=self.state is _S.STARTING)
        faults = self._fault_summary() if self.recovery.faults or self.recovery.scheduler else ""
        reason = (f"{reason}; every rank dumps " + (f"step {step}" if step >= 0 else "its newest snapshot")
                  + (f"; faults: {faults}" if faults else ""))
        self.verdict = verdict
        self._move(event, reason, now)
        told = self.ranks.peers()
        if self.restart_all:
            stopped = [r for r in self.ranks if r.alive and self.agents.get(r.rank) is not None]
            for record in stopped:
                self._emit(KillRank(record.rank, record.pid, f"the job failed; its node agent writes its dying "
                                                             f"gasp of step {step} from memory", restart=False,
                                    agent=self.agents[record.rank]))
            told = tuple(r.peer for r in self.ranks if r not in stopped)
        self._emit(Broadcast(told, Action(ActionKind.DUMP_AND_EXIT, step, reason=reason, round=self.recovery.round)))
        self._finish(ExitCode.FAILED, reason)

    def _finish(self, code: ExitCode, reason: str) -> None:
        self.deadline = math.inf
        self.result = Finish(code, reason, self.dump_step)
        self._emit(self.result)
