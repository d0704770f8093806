"""What the ladder does when a member of the job is lost: a rank's process (it exited, went silent,
or would not leave its chip), a node with its agent's memory, MindSpore's scheduler, the controller
with node 0. Functions over the job's :class:`~mindft.flow.ladder.Ladder`, which the job calls with
its input; each enters the lost member's faults and takes the ladder's rung for them.

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
(:mod:`mindft.flow.rejoin`) and restarts every worker, node 0's ranks from their replicas
(:func:`rejoin`).
"""
from __future__ import annotations

import logging
from typing import Optional

from mindft.exitcodes import ExitCode, describe_exit
from mindft.flow.effects import KillRank
from mindft.flow.episode import SCHEDULER, Fault
from mindft.flow.inputs import ProcessExited, SchedulerLost
from mindft.flow.ladder import Ladder
from mindft.flow.ranks import RankRecord, RankState
from mindft.flow.replicas import rank_list
from mindft.flow.states import RECOVERY_STATES, TERMINAL_STATES, Event, JobState
from mindft.protocol import FaultKind, NodeLost

log = logging.getLogger(__name__)

_S = JobState


def rank_silent(ladder: Ladder, record: RankRecord, now: float) -> None:
    """``record``'s rank sent nothing for ``timeouts.dead_after``: a hang, unless it was told to
    leave its device, which it then left (a launcher may not have said so)."""
    fault = ladder.recovery.faults.get(record.rank)
    if fault is not None and fault.left_at >= 0:
        record.state, fault.exited = _stopped(fault), True
        ladder.stopped(record.rank, fault, now)
        return
    dead_after = ladder.timeouts.dead_after
    ladder.job.emit(KillRank(record.rank, record.pid, f"HANG: no message for {now - record.last_seen:.2f} s "
                                                       f"(timeouts.dead_after={dead_after:g} s)",
                             restart=not ladder.job.restart_all, agent=ladder.agents.get(record.rank)))
    ladder.add_fault(record, FaultKind.HANG, record.progress + 1, f"silent for {now - record.last_seen:.2f} s", now,
                     dead=True, at=record.last_seen)


def process_exited(ladder: Ladder, record: RankRecord, event: ProcessExited, will_restart: bool,
                   now: float) -> tuple[bool, str]:
    """A registered rank's process exited (the job started); what to answer its node agent."""
    fault = ladder.recovery.faults.get(event.rank) if ladder.job.state in RECOVERY_STATES else None
    if (fault is not None and ladder.job.restart_all and ladder.recovery.restart_all and fault.start_ordered
            and fault.process_pending and not record.alive and event.pid != record.pid and will_restart):
        # The process started for this round died before it registered: the others join a cluster it
        # cannot join any more (and its agent waits for a START), so every worker restarts again.
        fault.start_ordered = False
        ladder.restart_every_worker(f"rank {event.rank}'s new process {event.pid} exited with code "
                                    f"{event.returncode} before it registered", now)
        return True, f"rank {event.rank} starts again with every worker"
    # A process started for a recovery and killed before it registered has a pid the job never learnt.
    unregistered = fault is not None and fault.kill_ordered and not fault.exited and not record.alive
    if event.pid and record.pid and event.pid != record.pid and not unregistered:
        return True, f"pid {event.pid} is not rank {event.rank}'s current process"
    if ladder.job.state in TERMINAL_STATES:
        return True, "job already ended"
    if record.state is RankState.LOST:
        return True, f"rank {event.rank}'s node was lost: a new node starts it"
    if event.returncode in (ExitCode.DUMPED, ExitCode.DUMP_FAILED) or not will_restart:
        record.state = RankState.DEAD
        what = f"rank {event.rank} (pid {event.pid}) exited with code {event.returncode}"
        rewind = event.returncode == ExitCode.REWIND_REQUIRED
        ladder.fail(f"{what} ({describe_exit(event.returncode)}) and will not be restarted" if rewind
                    else f"{what} and will not be restarted", now,
                    verdict=ExitCode.REWIND_REQUIRED if rewind else -1)
        return True, f"rank {event.rank} lost: job failed"
    if fault is not None and fault.left_at >= 0:
        # It left its device as told: it comes back when the device does.
        if fault.exited:
            return True, f"rank {event.rank} had stopped as told"
        record.state, fault.exited = _stopped(fault), True
        log.info("rank=%d process exited %.2f s after it was told to stop (exit code %d)", event.rank,
                 now - fault.left_at, event.returncode)
        ladder.stopped(event.rank, fault, now)
        return True, f"rank {event.rank} stopped as told"
    if fault is not None and fault.device_pending:
        fault.left_at = now  # it left the chip being reset: it starts again once the chip is back
    # It died after the last message the job had from it (its agent polls; the exit's time is not said).
    ladder.add_fault(record, FaultKind.PROCESS_DIED, record.progress + 1,
                     f"process {event.pid} exited with code {event.returncode}", now, dead=True, exited=True,
                     at=record.last_seen)
    return True, f"rank {event.rank} marked dead"


def _stopped(fault: Fault) -> RankState:
    """A rank's state once its process stopped as told: off its device while the chip is reset,
    otherwise dead until its new process registers (a process killed so every worker restarts is
    not off its device)."""
    return RankState.OFF_DEVICE if fault.device_pending else RankState.DEAD


def process_registered(ladder: Ladder, record: RankRecord, old: Optional[RankRecord], incarnation: int,
                       now: float) -> None:
    """A new process of ``record``'s rank registered after the job started (it waits, paused,
    for a ROLLBACK): the new process a recovery waited for, or a fault repaired already."""
    rank = record.rank
    fault = ladder.recovery.faults.get(rank) if ladder.job.state in RECOVERY_STATES else None
    if fault is None:
        # The launcher restarted a rank before we noticed it died: a fault too,
        # already repaired by this registration.
        ladder.add_fault(record, FaultKind.PROCESS_DIED, old.progress + 1 if old else 0,
                         f"re-registered as incarnation {incarnation}", now, at=old.last_seen if old else None)
    else:
        fault.process_pending, fault.replica, fault.restore_from = False, None, ""  # from now on, what it registered
        ladder.recovery.lost.discard(rank)
        fault.left_at, fault.exited, fault.kill_ordered, fault.start_ordered = -1.0, False, False, False
        if fault.kind is FaultKind.HANG:
            fault.kind = FaultKind.PROCESS_DIED
        log.info("rank=%d restarted (incarnation %d): %s", rank, incarnation,
                 f"NODE LOST (node {fault.node}) repaired" if fault.node >= 0
                 else "with every worker" if fault.collateral else f"{fault.kind.name} repaired")
        if ladder.job.state in (_S.ROLLBACK, _S.RESUMING):
            # The new process missed this round's ROLLBACK: run the round again.
            ladder.enter_pausing(f"rank {rank} restarted during {ladder.job.state.value}", now)
    # Register carries the new process's held steps: it counts as its PAUSE acknowledgement.
    record.held_round = ladder.recovery.round
    ladder.recovery.know(record.held)
    ladder.recovery.waiting.discard(rank)
    ladder.advance(now)


def kill_late_leavers(ladder: Ladder, now: float) -> None:
    """Kill a rank told to leave its device (or killed) that has not exited within ``timeouts.leave``."""
    for rank, fault in list(ladder.recovery.faults.items()):
        if 0 <= fault.left_at and not fault.exited and now - fault.left_at > ladder.timeouts.leave:
            record = ladder.ranks.get(rank)
            fault.left_at, fault.kill_ordered = now, True  # one kill per period, until its exit is reported
            ladder.job.emit(KillRank(rank, record.pid, f"did not exit within {ladder.timeouts.leave:g} s "
                                                       f"(timeouts.leave)", restart=False,
                                     agent=ladder.agents.get(rank)))


def node_lost(ladder: Ladder, message: NodeLost, now: float) -> tuple[bool, str]:
    """A node and its agent's memory are gone (:class:`NodeLost`, from the agent that replaces it):
    its ranks can roll back only to the replica steps the new agent restored."""
    world, node = ladder.ranks.world_size, message.node
    if len(message.ranks) != len(message.steps) or not message.ranks:
        return False, "ranks and steps must be non-empty and of the same length"
    bad = next((r for r in (*message.ranks, *message.replicas_of) if not 0 <= r < world), None)
    if bad is not None:
        return False, f"rank {bad} is outside 0..{world - 1}"
    ladder.replicas.node_lost(node, message.replicas_of, ladder.job.state in TERMINAL_STATES)
    if ladder.job.state in TERMINAL_STATES:
        return True, f"the job already ended ({ladder.job.state.value})"
    if ladder.job.state is _S.STARTING:
        return True, "the job has not started: nothing to recover"
    rec = ladder.recovery
    if ladder.job.state is _S.NORMAL:  # the node died after the last message the job had from its ranks
        rec.begin(now, min((r.last_seen for r in map(ladder.ranks.get, message.ranks) if r is not None),
                           default=now))
    restart = ladder.job.state in (_S.ROLLBACK, _S.RESUMING)
    for rank, step in zip(message.ranks, message.steps):
        record = ladder.ranks.get(rank)
        if record is None:
            continue
        replica = (step,) if step >= 0 else ()
        reported = ladder.replicas.step(rank)
        detail = (f"node {node} lost" + (f": {message.reason}" if message.reason else "") + "; "
                  + (f"its new node restored its replica of step {step}" if step >= 0
                     else "no replica of it could be restored")
                  + (f" (last reported replicated: step {reported})" if reported >= 0 and reported != step else ""))
        log.warning("rank=%d NODE LOST in step %d in state %s: %s", rank, record.progress + 1,
                    ladder.job.state.value, detail)
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
        ladder.replicas.recovering(rank)
    why = f"node {node} lost with rank(s) {', '.join(map(str, message.ranks))}"
    # Before anything is paused for it (a new round makes the others' steps unknown). Workers
    # that restart together may be blocked in a collective with the lost ranks: they are
    # stopped first, and their agents write their dying-gasp checkpoints from memory.
    if ladder.job.restart_all or not ladder.replicas_fall_short(now, others=not restart):
        if not restart:
            ladder.advance(now)
        elif ladder.job.restart_all:
            ladder.restart_every_worker(why, now)
        else:
            ladder.enter_pausing(why, now)
    if ladder.job.state is _S.FAILED:
        return True, f"the job failed: {ladder.job.result.reason}"
    return True, f"{why}: they roll back to a step their replicas hold once their new processes register"


def scheduler_lost(ladder: Ladder, event: SchedulerLost, now: float) -> None:
    """MindSpore's scheduler died while the ranks trained: every worker restarts behind a new
    one (node 0's agent starts it before the first of them), or, when its agent used up its
    restarts or the job had not started, the job fails with dying gasps."""
    what = (f"MindSpore's scheduler, pid {event.pid}, {describe_exit(event.returncode)}"
            + (f"; its log: {event.cause}" if event.cause else ""))
    state = ladder.job.state
    if state in TERMINAL_STATES:
        log.info("%s after the job ended (%s)", what, state.value)
        return
    if state is _S.STARTING:
        ladder.fail(f"{what}, before every rank registered", now, Event.FAULT)
        return
    if not event.will_restart:
        ladder.fail(f"{what}; no new scheduler: node 0's agent used all its restarts (--max-restarts)", now)
        return
    rec = ladder.recovery
    if state is _S.NORMAL:
        rec.begin(now)
    log.warning("fault SCHEDULER_LOST in step %d in state %s: %s", ladder.ranks.slowest + 1, state.value, what)
    rec.scheduler = Fault(FaultKind.SCHEDULER_LOST, ladder.ranks.slowest + 1, what)
    ladder.restart_every_worker(rec.scheduler.describe(SCHEDULER), now)


def rejoin(ladder: Ladder, now: float, why: str = "the controller started again while the job was under way") -> None:
    """This controller was started again while the job was under way (:mod:`mindft.flow.rejoin`), or
    a standby took command (``why`` says which: :mod:`mindft.flow.standby`), and every rank's agent
    has said what it runs and holds: every worker restarts from its agent's memory (MindSpore's
    scheduler went with node 0, so no worker can go on in its cluster), the lost node's ranks from
    their replicas, which bound the rollback step as for
    :func:`node_lost`. A rank that never registered with this controller is known by what its
    agent said: a process to kill (pid 0 in the order: the job cannot address it), or none."""
    rec, survivors = ladder.recovery, ladder.survivors
    rec.begin(now)
    lost = survivors.lost()
    for rank, said in survivors.agents.items():
        if ladder.ranks.get(rank) is None:
            ladder.ranks.add(RankRecord(rank=rank, peer=b"", incarnation=said.incarnation, pid=said.pid,
                                        replica_endpoint="", held=(), last_seen=now, state=RankState.DEAD,
                                        progress=max(said.newest, 0)))
    step = max(r.progress for r in ladder.ranks) + 1  # the step the job was in, as far as anyone says
    for rank, said in sorted(survivors.agents.items()):
        record = ladder.ranks.get(rank)
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
            fault.restore_rank = replica.rank if replica is not None else -1
            if replica is not None and replica.rank >= 0:  # a node the job grows by: not lost, new
                fault.detail = (f"node {said.node} joins the job: it starts from rank {replica.rank}'s state of step "
                                f"{replica.step} on node {replica.node}")
                log.info("rank=%d %s", rank, fault.detail)
            else:
                fault.detail = (f"node {said.node} lost with the controller; "
                                + (f"its replica of step {replica.step} is on node {replica.node}" if replica
                                   else "no node keeps a replica of it"))
                log.warning("rank=%d NODE LOST: %s", rank, fault.detail)
            rec.lost.add(rank)
    gone = sorted(r for r, replica in lost.items() if replica is None or replica.rank < 0)
    nodes = ", ".join(map(str, sorted({survivors.agents[r].node for r in gone})))
    why += f" (node {nodes} lost with {rank_list(gone)})" if gone else ""
    ladder.restart_every_worker(why, now, Event.REJOIN)
