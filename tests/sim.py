"""A whole job without sockets: one :class:`~mindft.flow.Job`, N ranks driven by
:class:`~mindft.flow.Follower`, joined by in-memory FIFO links, on a simulated clock.

A seeded random scheduler picks the next thing to happen (a message delivered, a rank's
step, time passing), so one seed is one interleaving. Faults are scheduled with
:meth:`SimJob.fail_at` (a rank reports a fault inside a step), :meth:`SimJob.kill_at` (its
process dies there, its snapshots kept by the node agent) and :meth:`SimJob.device_reset_at`
(the device plugin resets its chip). Each node's agent is the real rule set,
:class:`~mindft.flow.agent.NodePolicy`: every process exit and every order of the job goes
through it, and the simulator only carries out what it decides (report, start, kill), as the
node agent's shell does; the job reaches each agent through its hello, as over ZeroMQ. :meth:`SimJob.run` checks
the flow's invariants as it goes and raises :class:`Violation` on the first broken one.

With ``collectives=True`` every step ends in an all-reduce, as in data-parallel training
with MCCL on CPU: a rank's step completes only when every rank of its communicator is in
the same step's collective; a rank blocked there obeys nothing; a process started while
processes of the running communicator live cannot join it (only a whole new set can).
:meth:`SimJob.lose_scheduler_at` kills MindSpore's scheduler when a rank enters a step: the
communicator it formed never completes a collective again, node 0's agent sees the exit a
moment later and its policy decides; the first worker node 0 starts after that must start a
new scheduler first (``renew_cluster``).

With a ``budget`` the job chooses the snapshot cadence: ranks report made-up step and
snapshot costs now and then, and every rank checks that a cadence the job announces never
changes a capture step it already decided about.

With ``nodes`` > 1 the ranks are spread over nodes whose agents replicate: each agent streams the
newest capture of each of its ranks to the keeper of the next node (newest wins: a capture not
sent yet replaces the one before), one push at a time per node; a push is one more thing the
scheduler picks among rank steps and deliveries, ``replica_speed`` times as likely as one of them
(0: only when the clock moves on), and is lost with chance ``replica_drop``; an acknowledgement
may be lost, so the keeper can hold a newer step than its agent reports. Each agent sends
``ReplicaReport`` about once a second, saying a rank's protection is lost when a capture waited
more than 5 s for its replica.
:meth:`SimJob.lose_node_at` loses a whole node inside a step: its processes, its agent's
memory and the replicas its keeper held, with no exit report (its launcher is gone too); after
``replace_after`` seconds a new node's agent restores its ranks' replicas from the next node,
reports ``NodeLost`` and starts them (or waits for the job's start order when every worker
restarts). A job that FAILED after a node loss must have had no step every rank (survivors,
and the lost ranks from their replicas) could restore; a rank restores only what it holds, so
a rollback to a step a replica does not hold is a violation.

Node 0 runs the controller (and MindSpore's scheduler, and the reset-file watcher): losing it
loses them too. Until it is replaced nothing reaches the job; then a new :class:`Job` starts
knowing nothing, node 0's new agent starts its ranks afresh, the other agents say hello with what
they run and hold, their live ranks reconnect and register again with how far they got, and the
new watcher's first read reports the chips still being reset. A StartWorker with ``restore_from``
first puts the rank's replica from the next node's keeper into its agent's memory.
:meth:`fault_in_phase` with ``kind="node"`` loses the rank's node when an episode reaches a phase.

``elastic=(MIN, MAX)`` makes the job elastic (tests/sim_elastic.py): a node lost for good
(``replace_after=math.inf``) is left behind, a spare or a launcher back is taken back, and the
simulator carries on with the job of each new world.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import NoReturn, Optional

from mindft.config import Timeouts
from mindft.exitcodes import ExitCode
from mindft.flow import (TRANSITIONS, Armed, Broadcast, DeviceFailed, DeviceFaulty, DeviceRecovered, Finish,
                         Finished, Follower, Job, JobState, KillRank, RankState, Resumed, Send,
                         StartRank, Transition)
from mindft.flow.agent import AbortJob, KillWorker, NodePolicy, StartWorker
from mindft.flow.inputs import SchedulerLost
from mindft.flow.cadence import Budget, Schedule
from mindft.flow.effects import GiveNode, Resize, broadcast_target
from mindft.flow.relay import Down, Relay, Up
from mindft.flow.elastic import ElasticRange
from mindft.protocol import (Action, ActionKind, AgentHello, Cadence, CostReport, Done, FaultKind, FaultReport,
                             Heartbeat, JobView, NodeLost, ProcessExit, Progress, RankOrder, Register, RegisterAck,
                             Replaced, ReplicaReport, WorldResize, RELAY_SEPARATOR)

TIMEOUTS = Timeouts(heartbeat_interval=0.5, heartbeat_misses=6, register=30.0, pause=10.0, repair=20.0,
                    rollback=10.0, resume=10.0)
_ALLOWED = {(source, target) for (source, _), target in TRANSITIONS.items()}
PLUGIN_PROCESS_WAIT = 60.0  # the device plugin waits this long for the processes on a chip to exit
REPORT_EVERY = 1.0  # s between an agent's replica reports (mindft.replica.sender.REPORT_INTERVAL)
AGENT_LOST_AFTER = 5.0  # s a capture may wait for its replica before the agent says protection is lost
_NONE_IN_ANY_STATE = dict.fromkeys(RankState, 0)
MAX_RESTARTS = 5  # each node agent's --max-restarts
# The phases of an episode a fault can be scheduled in (:meth:`SimJob.fault_in_phase`).
PHASES = ("pausing", "repairing", "leaving", "restarting", "rollback", "resuming")
RESIZING = "resizing"  # an elastic job's new world, from the resize until it trains (tests/sim_elastic.py)
_PHASE_OF = {JobState.PAUSING: "pausing", JobState.REPAIRING: "repairing", JobState.ROLLBACK: "rollback",
             JobState.RESUMING: "resuming"}


class Violation(AssertionError):
    """An invariant of the flow did not hold."""


class RankExit(Exception):
    """A simulated rank process ended (dump_and_exit)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _last_word(effect: Send) -> bool:
    """The ended job's answer to a process that registers late (dump, or finish, and exit) or to a
    node agent that says hello late (the job's end, so it stops waiting)."""
    message = effect.message
    return (isinstance(message, Action) and message.kind in (ActionKind.DUMP_AND_EXIT, ActionKind.FINISH)
            or isinstance(message, JobView) and message.state in (JobState.DONE, JobState.FAILED))


def pid_of(rank: int, incarnation: int) -> int:
    """A process id per incarnation, so an order meant for an older process can be told apart."""
    return 1000 + rank + 100_000 * incarnation


def agent_peer(node: int) -> bytes:
    return f"agent{node}".encode()


def relay_peer(node: int) -> bytes:
    return f"relay/{node}".encode()


def expected_state(steps: int) -> int:
    """The model is the running sum of step numbers: right only if every rollback was exact."""
    return steps * (steps + 1) // 2


class SimRank:
    """One rank process: its snapshots and model, and the RankHooks the follower calls."""

    def __init__(self, job: SimJob, rank: int, incarnation: int, snapshots: dict[int, int],
                 process: bool = True) -> None:
        self.sim, self.rank, self.incarnation = job, rank, incarnation
        world = f".w{job.world.resizes}" if job.world is not None and job.world.resizes else ""
        self.identity = f"rank{rank}.inc{incarnation}{world}".encode()
        self.follower = Follower(rank, job.snapshot_every)
        self.snapshots = dict(snapshots)
        self.position = 0 if not snapshots else max(snapshots)
        self.model = self.snapshots.get(self.position, 0)
        self.mode = "start"
        self.window_step = 0
        self.actions: deque[Action] = deque()
        self.armed: Optional[FaultKind] = None
        self.exit_code: Optional[int] = None
        self.last_sent = self.last_heard = self.last_beat = 0.0
        self.collective_step = 0
        self.released = False  # the collective it waits in completed
        # process=False: only what its agent's memory holds of the rank (the world was resized).
        self.communicator = job.join_communicator(self) if process else -1
        if not process:
            self.mode = "dead"

    @property
    def peer(self) -> bytes:
        """Where the job knows it: its own identity, or behind its node's relay."""
        if not self.sim.relays:
            return self.identity
        return relay_peer(self.sim.node_of(self.rank)) + RELAY_SEPARATOR + self.identity

    def on_cadence(self, message: Cadence | RegisterAck) -> None:
        wire = message.schedule if isinstance(message, Cadence) else message.cadence
        if not wire:
            return
        differs = self.follower.on_cadence(Schedule.from_wire(wire))
        if differs is not None:
            raise Violation(f"rank {self.rank} (deciding step {self.follower.deciding}) told a cadence "
                            f"{wire} that changes step {differs}, already decided")

    # ---- RankHooks ----
    def settle(self) -> list[int]:
        return sorted(self.snapshots)

    def restore(self, step: int) -> list[int]:
        if step not in self.snapshots:
            raise Violation(f"rank {self.rank} told to restore step {step} but holds {sorted(self.snapshots)}")
        self.model, self.position = self.snapshots[step], step
        self.snapshots = {s: v for s, v in self.snapshots.items() if s <= step}
        return sorted(self.snapshots)

    def resume(self, step: int) -> None:
        if self.position != step:
            raise Violation(f"rank {self.rank} resumes after {step} but stands at {self.position}")

    def arm(self, fault: FaultKind, detail: str) -> None:
        self.armed = fault

    def leave_device(self, reason: str) -> NoReturn:
        raise RankExit(ExitCode.LEFT_DEVICE)

    def dump_and_exit(self, step: int, reason: str) -> NoReturn:
        if step >= 0 and step not in self.snapshots:
            raise Violation(f"rank {self.rank} told to dump step {step} but holds {sorted(self.snapshots)}")
        raise RankExit(ExitCode.DUMPED)

    # ---- the rank's own loop, one event at a time ----
    @property
    def alive(self) -> bool:
        return self.mode not in ("exited", "dead")

    def enabled(self) -> bool:
        if self.mode == "collective":
            return self.released or self.sim.release_collective(self.collective_step, self.communicator)
        if self.mode == "start" or (self.actions and self.mode in ("barrier", "train", "follow", "window", "finish")):
            return True
        if self.mode == "train":
            return True
        return self.mode == "window" and self.follower.may_capture(self.window_step)

    def act(self) -> None:
        try:
            if self.mode == "collective":
                self.released = False
                self._complete(self.collective_step)
            elif self.mode == "start":
                self.sim.to_job(self, Register(self.rank, self.incarnation, pid_of(self.rank, self.incarnation),
                                               tuple(self.snapshots),
                                               collectives=self.sim.collectives))
                self.mode = "follow" if self.incarnation else "barrier"
            elif self.actions:
                self._obey(self.actions.popleft())
            elif self.mode == "train":
                self._step()
            elif self.mode == "window":
                self._capture(self.window_step)
        except RankExit as end:
            self.mode, self.exit_code = "exited", end.code
            self.sim.exited(self, end.code)

    def _obey(self, action: Action) -> None:
        before = self.mode
        ack, outcome = self.follower.obey(action, self)
        if ack is not None:
            self.sim.to_job(self, ack)
        if isinstance(outcome, Resumed):
            self.mode = "train"
        elif isinstance(outcome, Finished):
            self.mode, self.exit_code = "exited", ExitCode.OK
            self.sim.exited(self, ExitCode.OK)
        elif isinstance(outcome, Armed):
            self.mode = before if before in ("train", "window") else "train"
        elif before in ("train", "window"):
            self.mode = "follow"

    def _step(self) -> None:
        sim, step = self.sim, self.position + 1
        if step > sim.steps:
            self.sim.to_job(self, Done(self.rank, self.position))
            self.mode = "finish"
            return
        node = sim.node_of(self.rank)
        if (node, step) in sim.node_losses and node not in sim.lost_nodes:
            sim.lose_node(node, sim.node_losses.pop((node, step)))
            return
        if (self.rank, step, self.incarnation) in sim.kills:
            sim.injected.append((self.rank, sim.job.ranks.get(self.rank).progress + 1, step))
            self.mode = "dead"  # its node agent decides what follows
            sim.exited(self, -9)
            return
        fault = self.armed or sim.faults.pop((self.rank, step), None)
        if fault is not None:
            sim.injected.append((self.rank, step, step))
            self.armed = None
            self.sim.to_job(self, FaultReport(self.rank, step, fault, "simulated"))
            self.mode = "follow"
            return
        if sim.collectives:
            if step in sim.scheduler_losses:
                sim.lose_scheduler(step)
            self.mode, self.collective_step = "collective", step
            return
        self._complete(step)

    def _complete(self, step: int) -> None:
        self.mode = "train"
        self.model += step
        self.position = step
        sim = self.sim
        if sim.budget is not None and sim.random.random() < 0.3:
            # Made-up costs whose cadence (snapshot / (budget * step)) spans 1..max_replay and beyond.
            sim.to_job(self, CostReport(self.rank, sim.random.uniform(0.5, 1.5),
                                        sim.random.uniform(0.001, 0.06) * sim.budget.overhead * 100))
        end = self.follower.end_of_step(step)
        if end.capture:
            self.window_step, self.mode = step, "window"
            if not end.await_window:
                self._capture(step)
        else:
            self.sim.to_job(self, self.follower.finished(step))

    def _capture(self, step: int) -> None:
        self.snapshots[step] = self.model
        for old in sorted(self.snapshots)[:-self.follower.keep]:
            del self.snapshots[old]
        self.mode = "train"
        self.sim.push(self.rank, step, self.model)
        self.sim.to_job(self, self.follower.finished(step))


@dataclass
class SimJob:
    """The job, its ranks, the links between them and the schedule of faults."""

    world_size: int
    steps: int
    seed: int = 0
    snapshot_every: int = 1
    timeouts: Timeouts = TIMEOUTS
    faults: dict[tuple[int, int], FaultKind] = field(default_factory=dict)
    kills: set[tuple[int, int, int]] = field(default_factory=set)
    device_resets: dict[tuple[int, int], float] = field(default_factory=dict)  # (rank, step) -> reset seconds
    device_failures: set[tuple[int, int]] = field(default_factory=set)
    collectives: bool = False
    budget: Optional[Budget] = None
    nodes: int = 1
    replica_speed: int = 1     # how likely a push is picked next, against one rank step or delivery
    replica_drop: float = 0.0  # chance a push never arrives
    node_losses: dict[tuple[int, int], float] = field(default_factory=dict)  # (node, step) -> replace after s
    scheduler_losses: set[int] = field(default_factory=set)  # steps whose first entry kills MindSpore's scheduler
    phase_faults: list[tuple[str, int, str, float]] = field(default_factory=list)  # (phase, rank, kind, reset s)
    # Node 0 lost with the controller: the one that rebuilds the job is a standby on another node
    # (a term higher, commanding nothing until half of the node agents said hello), not node 0's own.
    standby: bool = False
    # MIN:MAX nodes (tests/sim_elastic.py): a node lost for good is left behind, a spare taken back.
    elastic: Optional[tuple[int, int]] = None
    shrink_after: float = 5.0
    # Each node's agent relays its ranks' traffic (mindft.flow.relay): acks of a phase as one batch,
    # steps as the node's heartbeat. Not with elastic jobs (their nodes are renumbered).
    relays: bool = False

    def __post_init__(self) -> None:
        if self.world_size % self.nodes:
            raise ValueError(f"{self.world_size} ranks do not spread evenly over {self.nodes} nodes")
        self.random = random.Random(self.seed)
        self.now = 0.0
        self.job = Job(self.world_size, self.timeouts, self.now, self.snapshot_every, budget=self.budget,
                       elastic=self.elastic_range)
        self.peers: dict[int, bytes] = {}  # node -> its agent's link, where not agent_peer(node) (elastic)
        from sim_elastic import ElasticWorld  # it builds on this module
        self.world = ElasticWorld(self) if self.elastic else None
        self.communicator, self.members = 0, 0
        self.dead_communicators: set[int] = set()  # formed by a scheduler that died
        self.scheduler_down = False  # until node 0's agent starts a new scheduler
        self.schedulers = 1  # started so far
        self.schedulers_lost = 0
        self.ranks: dict[int, SimRank] = {}
        self.ranks = {r: SimRank(self, r, 0, {0: 0}) for r in range(self.world_size)}
        self.up: deque[tuple[bytes, object]] = deque()     # rank -> job, one FIFO (ZeroMQ fair-queues)
        self.timers: list[tuple[float, str, object]] = []  # (when, kind, payload)
        self.transitions: list[tuple[JobState, JobState, float]] = []
        self.recovery_started: Optional[float] = None
        self.last_round = 0
        self.finished_at: Optional[float] = None
        self.failing = False  # True once an unrecoverable fault is scheduled
        self.left_at: dict[int, Optional[float]] = {}  # when each rank last left its device
        self.resetting: dict[int, tuple[float, float, object]] = {}  # rank -> (fault time, reset s, outcome)
        # Replication by the node agents: the keeper of the next node holds one replica per rank.
        self.keeper: dict[int, tuple[int, int, int]] = {}  # rank -> (push number, step, model)
        self.unsent: dict[int, tuple[int, int, int, int, int]] = {}  # rank -> newest push not sent yet
        self.confirmed: dict[int, int] = {}  # rank -> step its agent saw confirmed (what it reports)
        self.pushes: dict[int, int] = {}  # rank -> push number of its newest push
        self.behind_since: dict[int, float] = {}  # rank -> when a capture first waited for its replica
        self.lost_nodes: set[int] = set()  # nodes gone and not replaced yet
        self.node_epoch: dict[int, int] = {}  # node -> times it was lost (its in-flight pushes die with it)
        self.reported_at = 0.0
        self.node_lost = False  # a node was lost: a FAILED job must have had no common step
        self.truth: Optional[frozenset[int]] = None  # the steps every rank could restore when the job failed
        self.agents: dict[int, NodePolicy] = {}  # per node, from run() on (spread() may change the nodes)
        self.phase_hits: dict[str, int] = dict.fromkeys((*PHASES, RESIZING), 0)  # faults injected in each phase
        self.controller_lost = False  # node 0 is gone with the controller, not replaced yet
        self.controllers = 1  # started so far
        self.watch_pending = False  # a new controller's reset-file watcher has not read the file yet
        self.unrestored: set[int] = set()  # node 0's ranks on a new node, before their replica is restored
        # (rank, first, last) of every fault and kill inside a step: the steps the job may say it
        # was in (a killed process's step is the one after its last report that arrived).
        self.injected: list[tuple[int, int, int]] = []
        self.relay_of: dict[int, Relay] = {}  # node -> its relay (relays), new with its node or a new controller

    # ---- schedule ----
    def fail_at(self, rank: int, step: int, kind: FaultKind = FaultKind.UCE) -> SimJob:
        self.faults[(rank, step)] = kind
        return self

    def kill_at(self, rank: int, step: int, incarnation: int = 0) -> SimJob:
        self.kills.add((rank, step, incarnation))
        return self

    def spread(self, nodes: int, replica_speed: int = 1, replica_drop: float = 0.0) -> SimJob:
        """Spread the ranks over ``nodes`` nodes whose agents replicate (see the module docstring)."""
        if self.world_size % nodes:
            raise ValueError(f"{self.world_size} ranks do not spread evenly over {nodes} nodes")
        self.nodes, self.replica_speed, self.replica_drop = nodes, replica_speed, replica_drop
        return self

    def lose_node_at(self, node: int, step: int, replace_after: float = 2.0) -> SimJob:
        """Node ``node`` is lost when one of its ranks enters ``step``; a new node replaces it later
        (``math.inf``: never; only in an elastic job, and not node 0, which runs the controller)."""
        if not 0 <= node < self.nodes or self.nodes < 2:
            raise ValueError(f"no node {node} of {self.nodes} to lose (a lost node needs a next one)")
        if math.isinf(replace_after) and (node == 0 or self.elastic is None):
            raise ValueError("only a node other than 0 of an elastic job is lost for good")
        self.node_losses[(node, step)] = replace_after
        return self

    def lose_scheduler_at(self, step: int) -> SimJob:
        """MindSpore's scheduler dies when the first rank enters ``step`` (a job with collectives)."""
        if not self.collectives:
            raise ValueError("only a job with collectives (init()) has MindSpore's scheduler")
        self.scheduler_losses.add(step)
        return self

    def device_reset_at(self, rank: int, step: int, seconds: float = 1.0, fails: bool = False) -> SimJob:
        self.device_resets[(rank, step)] = seconds
        if fails:
            self.device_failures.add((rank, step))
            self.failing = True
        return self

    def fault_in_phase(self, phase: str, rank: int, kind: str = "device", seconds: float = 1.0) -> SimJob:
        """When an episode first reaches ``phase`` (one of :data:`PHASES`; "leaving": a rank was
        told to leave its device or killed and its process still runs; "restarting": a process
        was ordered started and has not registered; or :data:`RESIZING`, a kill waiting for the rank's
        new process), rank ``rank``'s chip faults and is reset for ``seconds`` ("device", if its process
        runs), its process is killed ("kill"), or its node is lost and replaced ``seconds`` later
        ("node"; rank and node numbers are the world's at that moment)."""
        if phase not in (*PHASES, RESIZING) or kind not in ("device", "kill", "node"):
            raise ValueError(f"phase must be one of {(*PHASES, RESIZING)} and kind 'device', 'kill' or 'node', got "
                             f"{phase!r}, {kind!r}")
        self.phase_faults.append((phase, rank, kind, seconds))
        return self

    def _phases(self) -> set[str]:
        """The phases of an episode the job is in now."""
        job = self.job
        phase = _PHASE_OF.get(job.state)
        resizing = {RESIZING} if self.world is not None and self.world.resizing else set()
        if phase is None:
            return resizing
        phases = {phase} | resizing
        for number, fault in job.recovery.faults.items():
            if fault.left_at >= 0 and not fault.exited and self.ranks[number].alive:
                phases.add("leaving")
            if fault.start_ordered and fault.process_pending:
                phases.add("restarting")
        return phases

    def _phase_faults(self) -> None:
        if not self.phase_faults or self.job.result is not None or self.controller_lost:
            return
        phases = self._phases()
        for planned in [p for p in self.phase_faults if p[0] in phases]:
            phase, number, kind, seconds = planned
            rank = self.ranks.get(number)
            if phase == RESIZING and kind == "kill" and rank is not None and not rank.alive:
                continue  # the new world's process is not started yet: killed once it is, if still resizing
            self.phase_faults.remove(planned)
            if rank is None:
                continue  # no such rank in the world the job shrank to
            if (not rank.alive and kind != "node") or self.node_of(number) in self.lost_nodes:
                continue
            self.phase_hits[phase] += 1
            if kind == "node":
                if self.nodes > 1:
                    self.lose_node(self.node_of(number), seconds)
            elif kind == "kill":
                record = self.job.ranks.get(number)
                self.injected.append((number, record.progress + 1 if record else 0, rank.position + 1))
                rank.mode = "dead"
                self.exited(rank, -9)
            elif number not in self.resetting and self.job.ranks.get(number) is not None:
                self._apply(self.job.device(DeviceFaulty(number, "8C03A000", "reset"), self.now))
                self.resetting[number] = (self.now, seconds, DeviceRecovered(number))

    # ---- the communicator ----
    def join_communicator(self, rank: SimRank) -> int:
        """The communicator a new process joins: the forming one, a new one when no process of
        the current one lives (a new scheduler), else none (-1: its collectives never complete)."""
        if self.members < self.world_size and self.communicator not in self.dead_communicators:
            self.members += 1
            return self.communicator
        if any(r.alive and r.communicator == self.communicator for r in self.ranks.values() if r is not rank):
            return -1
        self.communicator, self.members = self.communicator + 1, 1
        return self.communicator

    def release_collective(self, step: int, communicator: int) -> bool:
        """True (and every participant released) once every rank waits in ``step``'s collective."""
        ranks = self.ranks.values()
        if communicator < 0 or communicator in self.dead_communicators or len(self.ranks) < self.world_size or not all(
                r.mode == "collective" and r.collective_step == step and r.communicator == communicator
                for r in ranks):
            return False
        for rank in ranks:
            rank.released = True
        return True

    def lose_scheduler(self, step: int) -> None:
        """The scheduler dies: its communicator with it; node 0's agent notices a moment later."""
        self.scheduler_losses.discard(step)
        self.dead_communicators.add(self.communicator)
        self.scheduler_down = True
        self.schedulers_lost += 1
        self.timers.append((self.now + 0.1, "scheduler", 76 + self.schedulers))

    # ---- nodes and replicas ----
    @property
    def elastic_range(self) -> Optional[ElasticRange]:
        return None if self.elastic is None else ElasticRange(*self.elastic, self.shrink_after)

    def peer_of(self, node: int) -> bytes:
        """The link of node ``node``'s agent."""
        return self.peers.get(node) or agent_peer(node)

    def node_at(self, peer: bytes) -> int:
        """The node whose agent is at ``peer`` (-1: none of this world's)."""
        return next((node for node in self.agents if self.peer_of(node) == peer), -1)

    def node_of(self, rank: int) -> int:
        return rank // (self.world_size // self.nodes)

    def node_ranks(self, node: int) -> tuple[int, ...]:
        per = self.world_size // self.nodes
        return tuple(range(node * per, (node + 1) * per))

    def push(self, rank: int, step: int, model: int) -> None:
        """The rank's agent will stream this capture to the next node's keeper (newest wins)."""
        if self.nodes < 2:
            return
        self.pushes[rank] = number = self.pushes.get(rank, 0) + 1
        self.behind_since.setdefault(rank, self.now)
        node = self.node_of(rank)
        self.unsent[rank] = (number, step, model, node, self.node_epoch.get(node, 0))

    def _send_replica(self) -> None:
        """One push reaches its keeper (or is lost on the way)."""
        rank = self.random.choice(sorted(self.unsent))
        number, step, model, node, epoch = self.unsent.pop(rank)
        if self.random.random() >= self.replica_drop:
            self._replica_arrives(rank, number, step, model, node, epoch)

    def _replica_arrives(self, rank: int, number: int, step: int, model: int, node: int, epoch: int) -> None:
        keeper_node = (node + 1) % self.nodes
        if self.node_epoch.get(node, 0) != epoch or node in self.lost_nodes or keeper_node in self.lost_nodes:
            return  # the sender's node or the keeper's is gone
        if self.keeper.get(rank, (0,))[0] > number:
            return  # a newer push already arrived
        self.keeper[rank] = (number, step, model)
        if self.random.random() < 0.9:  # else the acknowledgement is lost: the keeper holds more than reported
            self.confirmed[rank] = step
            if number == self.pushes.get(rank):
                self.behind_since.pop(rank, None)

    def _report_replicas(self) -> None:
        if self.nodes < 2 or self.now - self.reported_at < REPORT_EVERY or self.finished_at is not None:
            return
        self.reported_at = self.now
        for node in range(self.nodes):
            if node in self.lost_nodes:
                continue
            ranks = self.node_ranks(node)
            lost = tuple(r for r in ranks if self.now - self.behind_since.get(r, self.now) > AGENT_LOST_AFTER)
            report = ReplicaReport(node, ranks, tuple(self.confirmed.get(r, -1) for r in ranks), lost)
            self._apply_agent(self.job.handle(self.peer_of(node), report, self.now))

    def lose_node(self, node: int, replace_after: float) -> None:
        """The node dies: processes, the agent's memory and the replicas its keeper held; nobody reports it."""
        self.node_lost = True
        self.lost_nodes.add(node)
        self.relay_of.pop(node, None)  # what it held back goes with it
        self.node_epoch[node] = self.node_epoch.get(node, 0) + 1
        for number in self.node_ranks(node):
            rank = self.ranks[number]
            if rank.mode != "exited":
                rank.mode = "dead"
            rank.snapshots = {}
            self.unsent.pop(number, None)
            self.confirmed.pop(number, None)
            self.behind_since.pop(number, None)
            self.resetting.pop(number, None)
        for number in self.node_ranks((node - 1) % self.nodes):
            self.keeper.pop(number, None)  # the replicas this node's keeper held
        if node == 0 and self.finished_at is None:
            # The controller and MindSpore's scheduler go with it: no communicator completes again.
            self.controller_lost = True
            self.dead_communicators.add(self.communicator)
            self.timers = [t for t in self.timers if t[1] != "scheduler"]
        self.timers.append((self.now + replace_after, "replace", node))

    def _replace_node(self, node: int, adoption: int = 0) -> None:
        """A new node's agent (a spare's, by ``adoption``) restores its ranks' replicas from the next
        node, reports the loss, starts them."""
        self.lost_nodes.discard(node)
        if self.controller_lost and node == 0:
            self._restart_controller()
            return
        if self.job.result is not None:
            return
        ranks = self.node_ranks(node)
        if self.controller_lost or not NodePolicy.replaces_lost_node(self.job.state, range(self.world_size), ranks):
            # Its new agent finds no job under way (no controller, or one starting): it starts its ranks afresh.
            for number in ranks:
                self.ranks[number] = SimRank(self, number, 0, {})
            self._start_agent(node)
            return
        buddy = (node + 1) % self.nodes
        steps = []
        for number in ranks:
            held = None if buddy in self.lost_nodes else self.keeper.get(number)
            self.ranks[number].snapshots = {} if held is None else {held[1]: held[2]}
            steps.append(-1 if held is None else held[1])
        report = NodeLost(node, ranks, tuple(steps), self.node_ranks((node - 1) % self.nodes), "simulated",
                          adoption=adoption)
        self._apply_agent(self.job.handle(self.peer_of(node), report, self.now))
        # Every worker restarts together: a start order given while the node was gone comes again
        # in answer to the new agent's hello.
        self._start_agent(node, replacing=True)

    def _restart_controller(self) -> None:
        """Node 0 is back: a new controller that knows nothing, a new scheduler, node 0's ranks
        started afresh with nothing in memory; the others' agents and live ranks find it."""
        self.controller_lost = False
        self.controllers += 1
        self.job = Job(self.world_size, self.timeouts, self.now, self.snapshot_every, budget=self.budget,
                       term=self.controllers - 1 if self.standby else 0, standing_by=self.standby,
                       elastic=self.elastic_range)
        self.up.clear()  # sent to the lost controller
        for relay in self.relay_of.values():  # the relays follow the new controller
            relay.new_controller()
        self.last_round, self.recovery_started, self.watch_pending = 0, None, True
        self.scheduler_down, self.schedulers = False, self.schedulers + 1
        for number in self.node_ranks(0):
            self.ranks[number] = SimRank(self, number, 0, {})
            self.unrestored.add(number)
        self._start_agent(0)
        for node in range(1, self.nodes):
            if node not in self.lost_nodes:
                self.timers.append((self.now + self.random.uniform(0.0, 2.0), "hello", node))
        for rank in self.ranks.values():
            if rank.alive and self.node_of(rank.rank) != 0:
                self.timers.append((self.now + self.random.uniform(0.0, 1.0), "reconnect", rank))

    def hello(self, node: int) -> AgentHello:
        """What node ``node``'s agent says it runs and holds (its memory: its ranks' snapshots; a
        first process holds the initial state, step 0, only once past the start barrier)."""
        ranks, workers = self.node_ranks(node), self.agents[node].workers
        kept = {r: self.keeper[r][1] for r in self.node_ranks((node - 1) % self.nodes) if r in self.keeper}

        def newest(rank: SimRank) -> int:
            fresh = rank.incarnation == 0 and rank.mode in ("start", "barrier")
            return -1 if fresh else max(rank.snapshots, default=-1)
        return AgentHello(node, ranks, tuple(workers[r].pid or 0 for r in ranks),
                          tuple(workers[r].restarts for r in ranks), tuple(newest(self.ranks[r]) for r in ranks),
                          f"keeper{node}", tuple(kept), tuple(kept.values()),
                          term=self.world.known_term(node) if self.world is not None else 0)

    def _start_agent(self, node: int, replacing: bool = False) -> None:
        """A node agent starts: it starts its ranks (or, replacing a lost node, rejoins them as its
        policy says) and says hello to the job."""
        ranks = self.node_ranks(node)
        policy = self.agents[node] = NodePolicy(ranks, MAX_RESTARTS, runs_controller=node == 0)
        if replacing and node == 0 and self.scheduler_down:  # node 0's agent starts a scheduler first
            self.scheduler_down, self.schedulers = False, self.schedulers + 1
        if replacing:
            status = self.job.status(self.now)
            policy.on_view(JobView(status.state, status.restart_all, reason=status.reason))
            incarnations = {row.rank: row.incarnation for row in status.ranks if row.rank in ranks}
            self._carry_out(node, policy.rejoin(incarnations))
        else:
            for number in ranks:
                policy.started(number, pid_of(number, 0))
        if not self.controller_lost:  # else it says hello to the next controller
            self._apply(self.job.handle(self.peer_of(node), self.hello(node), self.now))

    def exited(self, rank: SimRank, code: int) -> None:
        """A rank's process ended; its agent notices a moment later."""
        self.timers.append((self.now + 0.1, "exited", (rank, code)))

    def _order(self, agent: Optional[bytes], order: RankOrder) -> None:
        if agent is None:
            raise Violation(f"the job ordered {order.kind.value} for rank {order.rank} without its agent's address")
        node = self.node_at(agent)
        if node < 0 or node in self.lost_nodes:
            return  # the agent went with its node, or the world it ran: the order is lost
        self._carry_out(node, self.agents[node].on_order(order))

    def _carry_out(self, node: int, effects: list) -> None:
        """What a node agent's policy decided, done as the agent's shell does it."""
        for effect in effects:
            if isinstance(effect, ProcessExit):  # on the agent's link, as the shell sends it
                if not self.controller_lost:  # else lost with the link: the agent's next hello says it
                    self._apply_agent(self.job.handle(self.peer_of(node), effect, self.now))
            elif isinstance(effect, SchedulerLost):  # in the controller's process, as node 0's shell reports it
                self._apply(self.job.scheduler_lost(effect, self.now))
            elif isinstance(effect, StartWorker):
                if effect.restore_from and effect.restore_rank >= 0:
                    self.world.copy(effect.rank, effect.restore_from, effect.restore_rank)
                elif effect.restore_from:
                    self._restore(effect.rank, effect.restore_from)
                if node == 0 and effect.renew_cluster:
                    # A new scheduler: the cluster the old one was forming is given up with it.
                    self.dead_communicators.add(self.communicator)
                    self.scheduler_down, self.schedulers = False, self.schedulers + 1
                elif node == 0 and self.scheduler_down:
                    raise Violation(f"node 0 started rank {effect.rank} with MindSpore's scheduler dead")
                self.timers.append((self.now + 0.2, "restart", (self.ranks[effect.rank], effect.restarts)))
            elif isinstance(effect, KillWorker):
                rank = self.ranks[effect.rank]
                if rank.alive and pid_of(rank.rank, rank.incarnation) == effect.pid:
                    rank.mode = "dead"
                    self.exited(rank, -9)
            elif isinstance(effect, AbortJob) and self.job.result is None:
                raise Violation(f"node {node}'s agent failed the job while it ran: {effect.reason}")

    def _restore(self, number: int, keeper: str) -> None:
        """The agent puts the rank's replica from the next node's keeper into its memory."""
        buddy = (self.node_of(number) + 1) % self.nodes
        if keeper != f"keeper{buddy}":
            raise Violation(f"rank {number} told to restore its replica from {keeper}, not from node {buddy}'s keeper")
        held = None if buddy in self.lost_nodes else self.keeper.get(number)
        self.ranks[number].snapshots = {} if held is None else {held[1]: held[2]}
        self.unrestored.discard(number)

    def _apply_agent(self, effects: list) -> None:
        """Effects of an agent's request: its reply goes to the agent, the rest to the job."""
        self._apply([e for e in effects if not (isinstance(e, Send) and e.peer.startswith(b"agent")
                                                and not isinstance(e.message, (JobView, Replaced)))])

    def _restorable(self) -> frozenset[int]:
        """The steps every rank could restore now: from its process or its agent's memory, a lost
        node's ranks from their replicas on the next node."""
        common: Optional[set[int]] = None
        for number, rank in self.ranks.items():
            if self.node_of(number) in self.lost_nodes or number in self.unrestored:
                held = self.keeper.get(number) if (self.node_of(number) + 1) % self.nodes not in self.lost_nodes \
                    else None
                steps = set() if held is None else {held[1]}
            else:
                steps = set(rank.snapshots)
            common = steps if common is None else common & steps
        return frozenset(common or ())

    # ---- plumbing ----
    def to_job(self, rank: SimRank, message: object) -> None:
        rank.last_sent = self.now
        if not self.relays:
            self.up.append((rank.peer, message))
            return
        node = self.node_of(rank.rank)
        for effect in self.relay(node).from_rank(rank.identity, message, self.now):
            if isinstance(effect, Down):
                rank.last_heard = self.now  # the relay answered its heartbeat
            else:
                self._relayed(node, effect)

    def relay(self, node: int) -> Relay:
        if node not in self.relay_of:
            interval = self.timeouts.heartbeat_interval
            self.relay_of[node] = Relay(0.05, interval, 2 * interval, self.now)
        return self.relay_of[node]

    def _relayed(self, node: int, up: Up) -> None:
        suffix = RELAY_SEPARATOR + up.identity if up.identity else b""
        self.up.append((relay_peer(node) + suffix, up.message))

    def _deliver(self, peers: tuple[bytes, ...], message: object) -> None:
        if isinstance(message, (WorldResize, Replaced)) and self.world is not None:
            self.world.told(peers, message)
            return
        if isinstance(message, JobView):
            for node, policy in self.agents.items():
                if self.peer_of(node) in peers and node not in self.lost_nodes:
                    policy.on_view(message)
            return
        if self.relays:
            for node, relay in self.relay_of.items():
                if relay_peer(node) + RELAY_SEPARATOR in peers:
                    relay.from_controller(message, self.now)
        for rank in self.ranks.values():
            if (rank.peer in peers or broadcast_target(rank.peer) in peers) and rank.alive:
                rank.last_heard = self.now
                if isinstance(message, Progress):
                    rank.follower.on_progress(message.step)
                elif isinstance(message, Action):
                    rank.actions.append(message)
                elif isinstance(message, (Cadence, RegisterAck)):
                    rank.on_cadence(message)
                    if isinstance(message, RegisterAck) and rank.mode == "barrier":
                        rank.mode = "train"  # RegisterAck after the start barrier

    def _apply(self, effects: list) -> None:
        self._check_bookkeeping()  # every input of the job comes with its effects through here
        if self.finished_at is not None and any(isinstance(e, Broadcast) or (isinstance(e, Send) and not _last_word(e))
                                                for e in effects):
            raise Violation(f"message after the job ended: {effects}")
        for effect in effects:
            if isinstance(effect, Send):
                self._deliver((effect.peer,), effect.message)
            elif isinstance(effect, Broadcast):
                self._deliver(effect.peers, effect.message)
            elif isinstance(effect, Transition):
                self._on_transition(effect)
            elif isinstance(effect, KillRank):
                self._order(effect.agent, effect.order())
            elif isinstance(effect, StartRank):
                # (An order repeated in answer to an agent's hello may cross the start of the process.)
                if self.ranks[effect.rank].alive and not effect.reason.startswith("still to be started"):
                    raise Violation(f"told to start rank {effect.rank}, whose process is still running")
                if effect.rank in self.resetting or any(kind == "device" and payload.rank == effect.rank
                                                        for _, kind, payload in self.timers):
                    raise Violation(f"told to start rank {effect.rank} before its device was back")
                self._order(effect.agent, effect.order())
            elif isinstance(effect, (Resize, GiveNode)):
                if self.world is None:
                    raise Violation(f"{type(effect).__name__} in a job that is not elastic and has no spare")
                self.world.effect(effect)
            elif isinstance(effect, Finish):
                self.finished_at = self.now
                if effect.exit_code != ExitCode.OK:
                    self.truth = self._restorable()

    def _check_bookkeeping(self) -> None:
        """The rank table's incremental counts, ``alive`` flags, ranks down and broadcast peers match a
        full recount; no round waits for a rank that was told to leave its device or killed."""
        recovery = self.job.recovery
        for number in recovery.waiting:
            fault = recovery.faults.get(number)
            if fault is not None and fault.left_at >= 0:
                raise Violation(f"round {recovery.round} ({self.job.state.value}) waits for rank {number}, "
                                f"which was told to leave its device or killed")
        table = self.job.ranks
        counted = _NONE_IN_ANY_STATE.copy()
        for record in table:
            counted[record.state] += 1
            if record.alive != (record.state not in (RankState.DEAD, RankState.OFF_DEVICE, RankState.LOST)):
                raise Violation(f"rank {record.rank} is {record.state.value} but alive={record.alive}")
        if counted != table.state_counts:
            state = next(s for s in RankState if counted[s] != table.count(s))
            raise Violation(f"the rank table counts {table.count(state)} rank(s) {state.value}, "
                            f"a recount finds {counted[state]}")
        live = {record.rank for record in table if record.alive}
        if table.live() != live or table.all_alive != (len(live) == len(table)):
            raise Violation(f"the rank table keeps rank(s) {sorted(table.live() ^ live)} on the wrong side of "
                            f"alive, a recount finds {sorted(set(table.numbers()) - live)} down")
        for target, (ranks, records) in table._known.items():  # what RankTable.reached kept per node
            if any(table.get(rank) is not record or record.target != target for rank, record in zip(ranks, records)):
                raise Violation(f"the rank table keeps records for node {target!r} that a lookup of ranks "
                                f"{list(ranks)} does not find (a record added or rebound since)")
        if table.peers() != tuple(dict.fromkeys(record.target for record in table if record.alive)):
            raise Violation(f"the rank table's kept broadcast peers {table.peers()!r} are not its live ranks' "
                            f"(a live record added, rebound or flipped without the peers recomputed)")

    def _on_transition(self, effect: Transition) -> None:
        if (effect.source, effect.target) not in _ALLOWED:
            raise Violation(f"transition {effect.source.value} → {effect.target.value} is not in the table")
        round_ = self.job.recovery.round
        if round_ < self.last_round:
            raise Violation(f"round went back from {self.last_round} to {round_}")
        self.last_round = round_
        if effect.source is JobState.STARTING and self.watch_pending:
            self.watch_pending = False
            self.timers.append((self.now, "watch", None))  # its first read, before any process can start
        if effect.target is JobState.PAUSING and self.recovery_started is None:
            self.recovery_started = self.now
        if effect.target in (JobState.NORMAL, JobState.FAILED) and self.recovery_started is not None:
            t = self.timeouts
            bound = (t.pause + t.repair + t.rollback + t.resume) * (1 + round_)
            if self.now - self.recovery_started > bound + 1e-9:
                raise Violation(f"recovery took {self.now - self.recovery_started:.2f} s, over its deadlines")
            self.recovery_started = None
        self.transitions.append((effect.source, effect.target, self.now))
        if self.world is not None:
            self.world.moved(effect)

    def _timers_due(self) -> None:
        due = [t for t in self.timers if t[0] <= self.now]
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, kind, payload in sorted(due, key=lambda t: t[0]):
            if self.world is not None and self.world.timer(kind, payload):
                continue
            if kind in ("exited", "restart") and self.node_of(payload[0].rank) in self.lost_nodes:
                continue  # its agent went with the node: no report, no restart (the new node's agent starts it)
            if kind == "exited":
                rank, code = payload
                node = self.node_of(rank.rank)
                if self.ranks.get(rank.rank) is rank:  # not a process its agent replaced, nor of a world before
                    if node in self.relay_of:  # no phase waits for it at its relay any more
                        for up in self.relay_of[node].rank_left(rank.rank, self.now):
                            self._relayed(node, up)
                    self._carry_out(node, self.agents[node].on_exit(rank.rank, code))
            elif kind == "restart" and self.job.result is None:
                old, incarnation = payload
                if old.rank in self.resetting or any(k == "device" and p.rank == old.rank for _, k, p in self.timers):
                    raise Violation(f"rank {old.rank}'s process started on its device while the device is reset")
                self.ranks[old.rank] = SimRank(self, old.rank, incarnation, old.snapshots)
                self.agents[self.node_of(old.rank)].started(old.rank, pid_of(old.rank, incarnation))
            elif kind == "replace":
                self._replace_node(payload)
            elif kind == "scheduler":
                self._carry_out(0, self.agents[0].on_scheduler_exit(payload, -9, "", "scheduler.log", formed=True))
            elif kind == "device" and not self.controller_lost:  # else read by the next watcher
                self._apply(self.job.device(payload, self.now))
            elif kind == "hello" and not self.controller_lost and payload not in self.lost_nodes:
                self._apply(self.job.handle(self.peer_of(payload), self.hello(payload), self.now))
            elif kind == "reconnect" and not self.controller_lost and self.ranks.get(payload.rank) is payload \
                    and payload.alive:
                started = payload.mode not in ("start", "barrier")
                self.to_job(payload, Register(payload.rank, payload.incarnation,
                                              pid_of(payload.rank, payload.incarnation), tuple(payload.snapshots),
                                              collectives=self.collectives, progress=payload.position if started else -1))
            elif kind == "watch" and self.job.result is None:
                # The new watcher's first read reports every chip still being reset.
                resetting = set(self.resetting) | {p.rank for _, k, p in self.timers if k == "device"}
                for number in sorted(resetting):
                    self._apply(self.job.device(DeviceFaulty(number, "8C03A000", "reset"), self.now))

    def _device_faults(self) -> None:
        for rank in self.ranks.values():
            key = (rank.rank, rank.position + 1)
            seconds = self.device_resets.pop(key, None)
            if seconds is None or rank.mode not in ("train", "window") or rank.rank in self.resetting:
                continue
            if not self.controller_lost:  # else the next controller's watcher reads it
                self._apply(self.job.device(DeviceFaulty(rank.rank, "8C03A000", "reset"), self.now))
            outcome = DeviceFailed(rank.rank, "reset failed") if key in self.device_failures \
                else DeviceRecovered(rank.rank)
            self.resetting[rank.rank] = (self.now, seconds, outcome)

    def _device_plugin(self) -> None:
        """As the plugin does: reset a chip only once its process is gone (waiting at most 60 s)."""
        for number, (since, seconds, outcome) in list(self.resetting.items()):
            if self.job.result is not None:
                del self.resetting[number]
            elif not self.ranks[number].alive:
                del self.resetting[number]
                self.timers.append((self.now + seconds, "device", outcome))
            elif self.now - since > PLUGIN_PROCESS_WAIT:
                raise Violation(f"rank {number}'s process was still on its device {PLUGIN_PROCESS_WAIT:g} s "
                                f"after the fault: the plugin would isolate it")

    # ---- the scheduler ----
    def run(self, max_events: int = 200_000, max_seconds: float = 600.0) -> SimJob:
        """Run until the job ends; raise :class:`Violation` on a broken invariant."""
        pick = self.random.random
        for node in range(self.nodes):
            if node not in self.agents:
                self._start_agent(node)
        for _ in range(max_events):
            if self.finished_at is not None and not self.up and not any(r.enabled() for r in self.ranks.values()):
                break
            choices: list = [rank for rank in self.ranks.values() if rank.alive and rank.enabled()]
            if self.up:
                choices.append("up")
            if self.unsent:
                choices += ["replica"] * self.replica_speed
            if not choices or pick() < 0.15:
                self._advance_clock()
                continue
            choice = choices[int(pick() * len(choices))]
            if choice == "up":
                peer, message = self.up.popleft()
                if not self.controller_lost:  # else lost with the controller
                    self._apply(self.job.handle(peer, message, self.now))
            elif choice == "replica":
                self._send_replica()
            else:
                choice.act()
            self._device_faults()
            self._phase_faults()
            if self.now > max_seconds:
                raise Violation(f"the job did not end within {max_seconds} simulated seconds "
                                f"(state {self.job.state.value})")
        else:
            raise Violation(f"the job did not end within {max_events} events (state {self.job.state.value})")
        return self

    def _advance_clock(self) -> None:
        step = 0.001 + self.random.random() * 0.05
        wakeup = math.inf if self.controller_lost else self.job.next_wakeup()
        targets = [self.now + step, wakeup, *(t[0] for t in self.timers)]
        self.now = max(self.now, min(targets))
        interval = self.timeouts.heartbeat_interval
        for rank in self.ranks.values():  # a rank's I/O thread heartbeats when nothing else flowed
            if rank.alive and rank.mode != "start" and (self.now - rank.last_sent >= interval or
                                                         self.now - max(rank.last_heard, rank.last_beat) >= interval):
                rank.last_beat = self.now
                self.to_job(rank, Heartbeat(rank.rank, rank.incarnation, rank.position))
        for node, relay in list(self.relay_of.items()):
            for up in relay.tick(self.now):
                self._relayed(node, up)
        self._timers_due()
        if self.world is not None and not self.controller_lost:
            self.world.tick()
        if self.unsent and not self.replica_speed:
            self._send_replica()
        self._device_plugin()
        if self.controller_lost:
            return
        job = self.job  # a timer may have started a new controller
        self._report_replicas()
        self._apply(job.tick(self.now))
        self._phase_faults()
        if self.finished_at is None and math.isinf(self.job.next_wakeup()):  # a resize's successor, if any
            raise Violation("the job stopped waking up before it ended")

    # ---- results ----
    @property
    def outcome(self) -> Optional[Finish]:
        return self.job.result

    def check_end(self) -> None:
        """The end state: DONE with every model exact, or FAILED with every live rank dumped."""
        result = self.job.result
        if result is None:
            raise Violation("the job has no result")
        if self.world is not None and self.world.check_end(result):
            return
        ranks = self.ranks.values()
        if result.exit_code == ExitCode.OK:
            for rank in ranks:
                if rank.exit_code != ExitCode.OK or rank.model != expected_state(self.steps):
                    raise Violation(f"job DONE but rank {rank.rank} exited {rank.exit_code} with model "
                                    f"{rank.model} (expected {expected_state(self.steps)})")
        else:
            # A rank that failed twice in one step (or, its step being the last it reported, one
            # apart) is deterministic: the job rightly ended.
            twice = any(rank == other and first - 1 <= until and since - 1 <= last
                        for i, (rank, first, last) in enumerate(self.injected)
                        for other, since, until in self.injected[i + 1:])
            deterministic = twice and "again after the job recovered" in result.reason
            if self.node_lost and not self.failing and self.truth and not deterministic:
                raise Violation(f"job FAILED after a node loss though every rank could restore step "
                                f"{max(self.truth)}: {result.reason}")
            if not self.failing and not self.node_lost and not deterministic:
                raise Violation(f"job FAILED though every fault was recoverable: {result.reason}")
            for rank in ranks:
                if rank.mode not in ("exited", "dead"):
                    raise Violation(f"job FAILED but rank {rank.rank} is still {rank.mode}")
