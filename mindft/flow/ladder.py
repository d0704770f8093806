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

The job holds its ladder (:class:`~mindft.flow.job.Job` makes one and passes itself in as the
:class:`Port`, all the ladder sees of it): the job turns messages and events into the ladder's
inputs (a fault, an acknowledgement, a device back, a hold), the ladder keeps the recovery under
way (:class:`~mindft.flow.episode.Episode`) and moves the job through the port: a transition of
the table, an effect going out, the end. What it does when a member is lost (a rank's process, a
node, MindSpore's scheduler, the controller with node 0) is :mod:`mindft.flow.lost`'s.
"""
from __future__ import annotations

import logging
import math
from typing import Mapping, Optional, Protocol, Sequence

from mindft.config import Timeouts
from mindft.exitcodes import ExitCode
from mindft.flow.cadence import Tuner
from mindft.flow.effects import Broadcast, Effect, Finish, KillRank, Peer, Send, StartRank
from mindft.flow.episode import ACK_FOR, PHASE_TIMEOUTS, Episode, Fault, retried
from mindft.flow.ranks import RankRecord, RankState, RankTable
from mindft.flow.rejoin import Survivors
from mindft.flow.replicas import ReplicaWatch, no_common_step, rank_list, replicas_share_a_step
from mindft.flow.states import RECOVERY_STATES, TERMINAL_STATES, Event, JobState
from mindft.protocol import Ack, Action, ActionKind, FaultKind, OrderKind, Progress

log = logging.getLogger(__name__)

_S = JobState


class Port(Protocol):
    """The job as its ladder sees it (:class:`~mindft.flow.job.Job` is one): its state, whether a
    lost process restarts every worker, how it ended, the deadline of the phase it waits in; and
    what the ladder does to it: move it through the table (the node agents are told), send an
    effect out, end it if every rank is done (``check_done``), end it with a result (``finish``)."""

    @property
    def state(self) -> JobState: ...
    @property
    def restart_all(self) -> bool: ...
    @property
    def result(self) -> Optional[Finish]: ...
    deadline: float

    def move(self, event: Event, reason: str, now: float) -> None: ...
    def emit(self, effect: Effect) -> None: ...
    def check_done(self, now: float) -> None: ...
    def finish(self, code: ExitCode, reason: str) -> None: ...


class Ladder:
    """One job's recovery ladder: the recovery under way (:attr:`recovery`), what the job recovered
    from before, and the rules that take a fault up the rungs. ``job`` is the job that holds it; the
    rank table, the node agents' links, the replicas' watch, what the agents said while the job
    starts and the snapshot cadence are the job's, shared with the ladder."""

    def __init__(self, job: Port, ranks: RankTable, timeouts: Timeouts, agents: Mapping[int, Peer],
                 replicas: ReplicaWatch, survivors: Survivors, tuner: Tuner) -> None:
        self.job = job
        self.ranks = ranks
        self.timeouts = timeouts
        self.agents = agents  # rank → the link of the node agent that runs its process
        self.replicas = replicas
        self.survivors = survivors
        self.tuner = tuner
        self.recovery = Episode()
        self.recoveries: list[float] = []  # how long each recovery took, seconds
        self.recovered: dict[tuple[int, FaultKind], int] = {}  # (rank, kind) → step of the last such fault repaired
        self.holding = False  # HoldRepairs: the fault manager is still collecting faults
        self.dump_step = -1  # the step every rank dumps when the job fails (-1: each its newest)
        self.verdict = -1  # the job's exit code whatever the ranks' (-1: from their codes)
        self._barrier_endpoints: dict[int, str] = {}
        self._changed: tuple[int, dict[int, str]] = (-1, {})  # _changed_endpoints(), and the table's ``added`` then

    # ---- faults and what the ranks say during a recovery -----------------------------------------

    def add_fault(self, record: RankRecord, kind: FaultKind, step: int, detail: str, now: float, *,
                  dead: bool = False, device: bool = False, exited: bool = False,
                  at: Optional[float] = None) -> None:
        """A fault of ``record``'s rank: it starts a recovery, joins the one under way (a new round
        if need be), or fails the job. ``at``: when the fault happened, if known before ``now`` (see
        :meth:`Episode.begin`)."""
        state, rank = self.job.state, record.rank
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
            self.fail(f"rank {rank} {kind.name} before every rank registered: {detail}", now, Event.FAULT)
            return
        if not retried(kind):
            self.fail(f"rank {rank} raised an exception from the training script in step {step}, not a device "
                      f"fault: {detail}", now, verdict=ExitCode.FAILED)
            return
        if self._again(rank, kind, step):
            self.fail(f"rank {rank} {kind.name} in step {step} again after the job recovered from it: a "
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
                restart = restart or state not in (_S.PAUSING, _S.REPAIRING) or (self.job.restart_all
                                                                                  and not rec.restart_all)
        if not restart:
            self.advance(now)
        elif self.job.restart_all and (dead or device or rec.restart_all):
            self.restart_every_worker(fault.describe(rank), now)
        else:
            self.enter_pausing(fault.describe(rank), now)

    def _again(self, rank: int, kind: FaultKind, step: int) -> bool:
        """Whether ``rank`` failed this way in this step before, and the job recovered from it (a
        chip reset is the device plugin's to judge)."""
        before = self.recovered.get((rank, kind))
        if before is None or kind is FaultKind.DEVICE_RESET:
            return False
        return abs(step - before) <= (1 if kind in (FaultKind.PROCESS_DIED, FaultKind.HANG) else 0)

    def device_recovered(self, rank: int, now: float) -> None:
        """The device plugin reset ``rank``'s chip: a rank that left it may start again."""
        fault = self.recovery.faults.get(rank)
        if fault is not None and fault.device_pending:
            fault.device_pending = False
            log.info("rank=%d device recovered", rank)
            self._start_if_ready(rank, fault)
            self.advance(now)

    def hold(self, active: bool, now: float) -> None:
        """:class:`~mindft.flow.inputs.HoldRepairs`: no repair ends while the fault manager collects faults."""
        self.holding = active
        log.info("repairs %s (the fault manager is %s)", "held" if active else "released",
                 "still collecting faults" if active else "done collecting faults")
        if not active:
            self.advance(now)

    def ack(self, record: RankRecord, message: Ack, now: float) -> None:
        """A rank acknowledged PAUSE, ROLLBACK or RESUME (one of another round or phase is ignored)."""
        if self.takes(message.action, message.step, message.round):
            self.acks(record.target, (record.rank,), message.action, message.held_steps, now)
        else:
            self.ignored((record.rank,), message.action, message.step, message.round)

    def takes(self, action: ActionKind, step: int, round_: int) -> bool:
        """Whether the phase under way waits for acknowledgements of ``action`` of ``round_`` at ``step``."""
        rec, state = self.recovery, self.job.state
        return (round_ == rec.round and action is ACK_FOR.get(state)
                and (state is not _S.ROLLBACK or step == rec.repair_step))

    def ignored(self, ranks: Sequence[int], action: ActionKind, step: int, round_: int) -> None:
        """``ranks``' acknowledgement that the phase under way does not take (:meth:`takes`), told why."""
        rec, state = self.recovery, self.job.state
        if round_ == rec.round and action is ACK_FOR.get(state):
            log.warning("%s restored step %d, expected %d; ignored", rank_list(ranks), step, rec.repair_step)
        else:
            log.info("%s: %s ack of round %d ignored in %s round %d", rank_list(ranks), action.name, round_,
                     state.value, rec.round)

    def acks(self, target: Peer, ranks: Sequence[int], action: ActionKind, held: Sequence[int],
             now: float) -> list[int]:
        """``ranks`` acknowledged ``action`` of the phase under way (:meth:`takes`), each holding ``held`` (one
        rank's :class:`~mindft.protocol.Ack`, or a node's :class:`~mindft.protocol.AckBatch`): those of them
        alive and reached through ``target`` (the rank's own peer, or the relay's of its node's ranks) are
        moved in one pass over their records. Returns the ranks not reached through ``target``."""
        rec = self.recovery
        held = tuple(held)
        if action is ActionKind.PAUSE:
            acked, strays = self.ranks.acknowledge(target, ranks, now, RankState.PAUSED, RankState.FAULTY,
                                                   held, rec.round)
            if acked:
                rec.know(held)
        elif action is ActionKind.ROLLBACK:
            # Restoring dropped its snapshots past the step: a dump from now on is of what is left.
            acked, strays = self.ranks.acknowledge(target, ranks, now, RankState.RESTORED, held=held)
        else:
            acked, strays = self.ranks.acknowledge(target, ranks, now, RankState.RESUMED)
        if acked:
            waiting = rec.waiting
            waiting.difference_update(acked)
            if not waiting:  # the phase waits for acknowledgements as long as any is missing
                self.advance(now)
        return strays

    # ---- the rounds ---------------------------------------------------------------------------

    def enter_pausing(self, why: str, now: float) -> None:
        """The first rung: a new round pauses every rank, which then rolls back in place."""
        rec = self.recovery
        self.job.move(Event.FAULT, why, now)
        rec.new_round()
        rec.waiting = self._answering()
        rec.repair_step = -1
        # A rank blocked in a collective never pauses: past timeouts.stall every worker restarts.
        self.job.deadline = now + (min(self.timeouts.pause, self.timeouts.stall) if self.job.restart_all
                                   else self.timeouts.pause)
        self.job.emit(Broadcast(self.ranks.peers(), Action(ActionKind.PAUSE, self.ranks.slowest, reason=why,
                                                           round=rec.round)))
        self.advance(now)

    def _answering(self) -> set[int]:
        """The ranks a new round waits for: every live rank but those told to leave their device
        or killed, which count as gone (their exit, or the kill after ``timeouts.leave``, follows)."""
        return self.ranks.live().difference([rank for rank, fault in self.recovery.faults.items()
                                              if fault.left_at >= 0])

    def restart_every_worker(self, why: str, now: float, event: Event = Event.FAULT) -> None:
        """The second rung: kill every process (their snapshots stay in the node agents' memory),
        start them all again once every one exited and every device is back, roll back."""
        rec = self.recovery
        self.job.move(event, f"{why}; restarting every worker from the node agents' memory", now)
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
                self.job.emit(KillRank(record.rank, record.pid if record.alive else 0, f"every worker restarts: {why}",
                                       restart=False, agent=self.agents.get(record.rank)))
                record.state, fault.exited, fault.kill_ordered = RankState.DEAD, False, True
        self.job.deadline = now + self.timeouts.repair
        self.advance(now)

    def advance(self, now: float) -> None:
        """Move forward through the recovery states as far as the rank table allows."""
        rec, job = self.recovery, self.job
        while job.state in RECOVERY_STATES:
            state = job.state
            if state in ACK_FOR and rec.waiting:
                return
            if state is _S.PAUSING:
                job.move(Event.ALL_PAUSED, "every live rank paused", now)
                job.deadline = now + self.timeouts.repair
            elif state is _S.REPAIRING:
                # A live rank whose fault needs nothing external (UCE, COMMUNICATION, UNKNOWN)
                # is repaired as soon as it waits; devices and lost processes are waited for.
                # Every live rank is paused here: a rank on a chip being reset (also one that
                # faulted during this phase) leaves it now.
                self._leave_devices(now)
                if rec.restart_all:
                    self._start_every_worker_if_ready()
                if self.replicas_fall_short(now):
                    return
                if self.holding or any(f.device_pending or f.process_pending for f in rec.faults.values()):
                    return
                if not self.ranks.all_alive:
                    return
                step = self._common_step(exact=True)
                if step < 0:
                    self.fail("no step is held by every rank, cannot roll back ("
                              + "; ".join(f"rank {r.rank} holds {list(r.held)}" for r in self.ranks) + ")", now)
                    return
                rec.repair_step = step
                job.move(Event.REPAIRED, f"every rank holds step {step}", now)
                rec.waiting = self.ranks.numbers()
                job.deadline = now + self.timeouts.rollback
                job.emit(Broadcast(self.ranks.peers(), Action(ActionKind.ROLLBACK, step,
                                                              endpoints=self._changed_endpoints(),
                                                              round=rec.round)))
            elif state is _S.ROLLBACK:
                job.move(Event.ALL_RESTORED, f"every rank restored step {rec.repair_step}", now)
                rec.waiting = self.ranks.numbers()
                self.ranks.reset_progress(rec.repair_step)
                job.deadline = now + self.timeouts.resume
                job.emit(Broadcast(self.ranks.peers(), Action(ActionKind.RESUME, rec.repair_step,
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
                self.job.emit(Send(record.peer, Action(ActionKind.LEAVE_DEVICE, record.progress,
                                                       reason=f"device reset: {fault.detail}",
                                                       round=self.recovery.round)))

    def stopped(self, rank: int, fault: Fault, now: float) -> None:
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
            self.job.emit(StartRank(rank, "its device was reset and is back", self.agents.get(rank), self._pid(rank),
                                    fault.restore_from, fault.restore_rank))

    def _start_every_worker_if_ready(self) -> None:
        """Start every stopped worker together once every one exited and every device is back."""
        stopped = {r: f for r, f in self.recovery.faults.items() if f.left_at >= 0}
        if self.holding or not all(f.exited and not f.device_pending for f in stopped.values()):
            return
        for number, waiting in sorted(stopped.items()):
            if not waiting.start_ordered:
                waiting.start_ordered = True
                self.job.emit(StartRank(number, "every worker restarts from the node agents' memory"
                                        + (f" (this one from its replica at {waiting.restore_from})"
                                           if waiting.restore_from else ""),
                                        self.agents.get(number), self._pid(number), waiting.restore_from,
                                        waiting.restore_rank))

    def _pid(self, rank: int) -> int:
        record = self.ranks.get(rank)
        return record.pid if record is not None else 0

    def order(self, rank: int) -> Optional[OrderKind]:
        """What the rank's node agent must still do for the recovery (None: nothing)."""
        fault = self.recovery.faults.get(rank) if self.job.state in RECOVERY_STATES else None
        return fault.pending_order() if fault is not None else None

    def repeat_order(self, rank: int, agent: Peer) -> None:
        """Order ``agent``, again, what it must still do for ``rank`` (its previous link may have lost it)."""
        order, record, fault = self.order(rank), self.ranks.get(rank), self.recovery.faults.get(rank)
        if order is OrderKind.KILL and record is not None:
            self.job.emit(KillRank(rank, record.pid, f"still to be killed: {fault.detail or fault.kind.name}",
                                   restart=False, agent=agent))
        elif order is OrderKind.START:
            self.job.emit(StartRank(rank, "still to be started for the recovery", agent,
                                    record.pid if record is not None else 0, fault.restore_from,
                                    fault.restore_rank))

    def remember_endpoints(self) -> None:
        """Every rank registered: the replica endpoints of the start barrier, which a ROLLBACK and a
        RESUME name again only where they changed (restarted ranks)."""
        self._barrier_endpoints = {r.rank: r.replica_endpoint for r in self.ranks}
        self._changed = (-1, {})

    def _changed_endpoints(self) -> dict[int, str]:
        """Replica endpoints that differ from the start barrier's map (restarted ranks). A record's endpoint
        is fixed: the map changes only when a record is added, so each phase of a round reuses it."""
        added, changed = self._changed
        if added != self.ranks.added:
            changed = {r.rank: r.replica_endpoint for r in self.ranks
                       if self._barrier_endpoints.get(r.rank) != r.replica_endpoint}
            self._changed = (self.ranks.added, changed)
        return dict(changed)

    def _finish_recovery(self, now: float) -> None:
        rec = self.recovery
        summary = rec.summary()
        self.job.move(Event.ALL_RESUMED, f"every rank resumed after step {rec.repair_step}", now)
        self.job.deadline = math.inf
        # Every rank heard now (resumed ranks may have finished: DONE stays).
        self.ranks.set_states(self.ranks, RankState.RUNNING, keep=RankState.DONE, seen=now)
        self.recoveries.append(now - rec.started)
        self.recovered.update(rec.seen)
        log.info("recovery %d done in %.3f s: %s; resumed after step %d", len(self.recoveries),
                 now - rec.started, summary, rec.repair_step)
        rec.faults.clear()
        rec.scheduler = None
        # Resumed ranks reported steps meanwhile; one waiting at its window must hear of them
        # (RESUME told every rank the repair step: nothing to say if no rank got further).
        if self.ranks.slowest > rec.repair_step:
            self.job.emit(Broadcast(self.ranks.peers(), Progress(self.ranks.slowest)))
        self.job.check_done(now)

    # ---- the dying gasp -----------------------------------------------------------------------

    def _common_step(self, exact: bool) -> int:
        """The newest step every rank holds (-1: none).

        ``exact`` uses only what the ranks reported this round; otherwise a rank that did not
        report is assumed to hold what its progress implies (so is every rank once training
        resumed: what they reported in the last round is stale).
        """
        common: Optional[frozenset[int]] = None
        if exact:
            # Ranks mostly hold the same steps, and a node's acknowledgement gives its ranks one tuple:
            # each distinct set is intersected once, most found by identity without hashing.
            lost, last, distinct = RankState.LOST, None, set()
            for record in self.ranks:
                held = record.held
                if held is last or record.state is lost:
                    continue
                last = held
                if held not in distinct:
                    distinct.add(held)
                    common = frozenset(held) if common is None else common.intersection(held)
            return max(common) if common else -1
        recovering = self.job.state in RECOVERY_STATES
        seen: dict[tuple[int, ...], frozenset[int]] = {}  # ranks mostly hold the same steps
        for record in self.ranks:
            if record.state is RankState.LOST:
                continue  # neither a process nor an agent's memory to dump from (it rolls back only when back)
            if recovering and record.held_round == self.recovery.round:
                held = seen.get(record.held)
                if held is None:
                    held = seen[record.held] = frozenset(record.held)
            else:
                held = self.tuner.schedule.held_after(record.progress)
            common = held if common is None else common & held
        return max(common) if common else -1

    def replicas_fall_short(self, now: float, others: bool = True) -> bool:
        """True, and the job failed, when no step can be common: a rank whose node was lost can
        roll back only to its replica's step, and these steps, with those of the other ranks known
        this round (``others``), share none. A rank not known yet could only narrow them, so the
        job takes every rank's dying-gasp checkpoint now rather than restart anything, and never a
        recovery that would lose the lost ranks' state. O(lost ranks): the others' steps are kept
        as a running intersection (:meth:`Episode.know`)."""
        rec = self.recovery
        lost = {r: rec.faults[r].replica or () for r in rec.lost}
        if replicas_share_a_step(lost, rec.known if others else None):
            return False
        known = [(r.rank, r.held) for r in self.ranks if others and r.rank not in lost and r.held_round == rec.round]
        self.fail(no_common_step(lost, (rec.faults[r].node for r in lost), known), now)
        return True

    def phase_timeout(self, now: float) -> None:
        """The deadline of the phase the job waits in passed."""
        state, rec = self.job.state, self.recovery
        name = PHASE_TIMEOUTS.get(state)
        if name is None:
            self.job.deadline = math.inf
            return
        if state is _S.PAUSING and self.job.restart_all:
            # The cause first: the ranks that did not pause are blocked in a collective with it.
            stalled = ", ".join(f"rank {r}" for r in sorted(rec.waiting))
            self.restart_every_worker(f"{rec.summary()}; {stalled} did not pause within {self.timeouts.stall:g} s "
                                      f"(timeouts.stall): blocked in a collective", now)
            return
        limit = getattr(self.timeouts, name)
        self.fail(f"{state.value} timed out after {limit:g} s (timeouts.{name}): waiting for "
                  f"{self.waiting_for() or 'nothing'}", now, Event.TIMEOUT)

    def waiting_for(self) -> str:
        """Who the current phase waits for, and why ("": nobody, or no phase waits)."""
        state, rec = self.job.state, self.recovery
        if state is _S.STARTING:
            unheard = self.survivors.unheard()
            if self.survivors.under_way and unheard:
                return f"the node agents of rank(s) {unheard} (the job was under way: this controller started again)"
            missing = self.ranks.missing()
            return f"rank(s) {missing} (not registered)" if missing else ""
        if state is _S.REPAIRING:
            return ", ".join(f"rank {r} ({f.repair_wait()})" for r, f in sorted(rec.faults.items())
                             if f.device_pending or f.process_pending)
        if state in ACK_FOR:
            return ", ".join(f"rank {r}" for r in sorted(rec.waiting))
        return ""

    def fail(self, reason: str, now: float, event: Event = Event.UNRECOVERABLE, verdict: int = -1) -> None:
        """The job fails: every rank dumps one step. ``verdict``: the job's exit code whatever the
        ranks' (-1: from theirs), for a deterministic failure, which would fail the same way again:
        1 as a script's uncaught exception, though the dumps were written.

        Where a rank may be blocked in a collective with a rank that is gone (``restart_all``) it
        obeys no order: every live worker is stopped instead, and its node agent writes its dying
        gasp from memory (the same snapshot the rank would write)."""
        state = self.job.state
        if state in TERMINAL_STATES:
            return
        # Before every rank registered, what each said it holds is all there is to go by.
        step = self.dump_step = self._common_step(exact=state is _S.STARTING)
        faults = self.recovery.summary() if self.recovery.faults or self.recovery.scheduler else ""
        reason = (f"{reason}; every rank dumps " + (f"step {step}" if step >= 0 else "its newest snapshot")
                  + (f"; faults: {faults}" if faults else ""))
        self.verdict = verdict
        self.job.move(event, reason, now)
        told = self.ranks.peers()
        if self.job.restart_all:
            stopped = [r for r in self.ranks if r.alive and self.agents.get(r.rank) is not None]
            for record in stopped:
                self.job.emit(KillRank(record.rank, record.pid, f"the job failed; its node agent writes its dying "
                                                                f"gasp of step {step} from memory", restart=False,
                                       agent=self.agents[record.rank]))
            told = tuple(r.peer for r in self.ranks if r not in stopped)
        self.job.emit(Broadcast(told, Action(ActionKind.DUMP_AND_EXIT, step, reason=reason,
                                             round=self.recovery.round)))
        self.job.finish(ExitCode.FAILED, reason)
