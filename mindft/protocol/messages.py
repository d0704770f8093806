"""The wire messages: versioned frozen dataclasses, and enums for every kind and state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Union

# 3: heartbeats are no longer broadcast; the controller answers a rank's Heartbeat with one
# of its own, and a rank sends one only when it sent, or heard, nothing else for an interval.
# 4: the job decides the snapshot cadence: ranks send CostReport, the job announces Cadence
# (and RegisterAck carries it); node agents send ReplicaReport; RankStatus.replicated and
# .replica_lost. Within 4 (a message added, none changed): NodeLost.
# 5: StatusReply carries the cadence, its cost and the budget; ReplicaReport.stream_seconds
# (the budget counts the node agents' streams); numbers must be finite.
# 6: ReplicaReport.cpu_seconds (the CPU a node's replication takes per snapshot) replaces
# .stream_seconds (a push's duration, which undercounts it where both ends work at once).
# 7: node agents hold a link to the controller (AgentHello) and receive their ranks' kill and start
# orders (RankOrder) and the job's view (JobView) on it; states and orders are enums on the wire.
# 8: FaultKind.SCHEDULER_LOST (MindSpore's scheduler died: every worker restarts behind a new one).
# 9: JobView.resetting (ranks whose chip is being reset: a crash of one waits for START like a hot reset's exit);
# FaultKind.USER_ERROR (an exception from the training script: the job ends); JobView.exit_code.
# 10: FaultReport.age (how long before its report the fault happened); StatusReply.step_time.
# 11: a controller started again rebuilds the job from what survives: Register.progress (a rank that
# reconnects says how far it got), AgentHello says what the agent runs and holds (pids,
# incarnations, newest, keeper, kept, kept_steps), RankOrder.restore_from (start from a replica).
# 12: warm spare nodes: AgentHello.spare, AdoptNode (the controller gives a lost node to a spare),
# NodeLost.adoption, Replaced (the answer to an agent whose node another agent runs now).
# Within 12: standby controllers: a term on JobView, RankOrder and AdoptNode (an older term's are
# refused), JobView.standbys (where the standbys listen), AgentHello.address and .term; Superseded (a
# controller that took command tells the one it replaced), Replaced.controller.
# 13: slow ranks: Pace (a rank's own work per step, a few times per window), RankStatus.work_ratio and .slow.
# 14: elastic data parallelism: WorldResize (the nodes that stay, renumbered; the next term).
# 15: the node agent relays its ranks' control traffic: a rank's own message crosses the agent's link
# as [rank identity, frame], the controller's to one rank likewise and to all of a relay's ranks as
# [b"", frame]; the agent answers a phase with AckBatch and reports steps with StepBatch.
PROTOCOL_VERSION = 15
# Large enough for an endpoint map of ~20k ranks; bigger frames are refused unread.
# A rank reports its steps from the training thread over a socket of its own, named after its
# control socket with this suffix, so the per-step report never wakes the rank's I/O thread.
REPORT_SUFFIX = b"/steps"
# The controller's address of a rank behind a relay: the relay's identity, this byte, the rank's
# identity; the relay's identity and this byte alone address every rank behind it (a broadcast).
RELAY_SEPARATOR = b"#"


def relay_cut(peer: bytes) -> int:
    """Where the relay's identity ends in ``peer``, the address of a rank behind a relay (-1: ``peer``
    is no such address). A relay sets its identity; those ZeroMQ makes up for peers that set none
    begin with a zero byte and may hold any byte, the separator too."""
    return -1 if peer[:1] == b"\x00" else peer.find(RELAY_SEPARATOR)
MAX_FRAME = 4 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame is not a valid mindft message; the message says why."""


class _WireEnum(str, enum.Enum):
    """An enum sent as its value, printed as its value."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class JobState(_WireEnum):
    """Where the job is in the recovery flow (:mod:`mindft.flow.states` holds the transitions)."""

    STARTING = "STARTING"    # waiting for every rank to register (start barrier)
    NORMAL = "NORMAL"        # training; ranks report progress without waiting
    PAUSING = "PAUSING"      # every live rank told to stop at its next step boundary and settle
    REPAIRING = "REPAIRING"  # waiting for devices to recover / restarted ranks to re-register
    ROLLBACK = "ROLLBACK"    # every rank restores the step they all hold
    RESUMING = "RESUMING"    # barrier before training continues
    FAILED = "FAILED"        # terminal: ranks dump and exit, the job exits non-zero
    DONE = "DONE"            # terminal: every rank finished


class RankState(_WireEnum):
    """The controller's view of one rank."""

    REGISTERED = "registered"  # waiting at the start barrier
    RUNNING = "running"
    FAULTY = "faulty"          # alive, reported or caused a fault, waiting
    DEAD = "dead"              # hung or exited; needs a new incarnation
    OFF_DEVICE = "off_device"  # left its device for a hot reset; started again when the device is back
    LOST = "lost"              # its node is gone (process and agent memory): only its replica is left
    PAUSED = "paused"
    RESTORED = "restored"
    RESUMED = "resumed"
    DONE = "done"              # finished training, waiting for the others


class OrderKind(_WireEnum):
    """What the controller orders a node agent to do with one of its ranks' processes."""

    KILL = "kill"    # kill its process (it hung, did not leave its device, or every worker restarts)
    START = "start"  # start it again (its device is back, or every worker restarts)


class FaultKind(_WireEnum):
    """Why a rank cannot continue."""

    DEVICE_RESET = "device_reset"     # device plugin hot-resets the chip
    UCE = "uce"                       # uncorrectable on-chip memory error
    COMMUNICATION = "communication"   # collective / link failure
    PROCESS_DIED = "process_died"     # the process exited (launcher report or re-register)
    HANG = "hang"                     # no heartbeat for timeouts.dead_after
    SCHEDULER_LOST = "scheduler_lost"  # MindSpore's scheduler died (a fault of the job, not of one rank)
    USER_ERROR = "user_error"         # an exception from the training script, not a device fault: not retried
    UNKNOWN = "unknown"


class ActionKind(_WireEnum):
    """What the controller tells a rank to do."""

    PAUSE = "pause"                  # stop at the next step boundary, settle snapshots, ack
    ROLLBACK = "rollback"            # restore snapshot ``step`` in place, ack
    RESUME = "resume"                # continue training after ``step``
    DUMP_AND_EXIT = "dump_and_exit"  # write the dying-gasp checkpoint of ``step`` and exit
    INJECT_FAULT = "inject_fault"    # raise ``fault`` at the next step boundary
    FINISH = "finish"                # every rank finished: leave
    LEAVE_DEVICE = "leave_device"    # exit so the device can be hot-reset; you will be started again


class DeviceStatus(_WireEnum):
    """Device events the launcher can forward over the wire (see ``mindft.device.watch``)."""

    FAULTY = "faulty"
    RECOVERED = "recovered"
    FAILED = "failed"


@dataclass(frozen=True)
class Register:
    """A rank joins (or re-joins after a restart with a higher incarnation)."""

    KIND: ClassVar[str] = "register"
    rank: int
    incarnation: int
    pid: int
    held_steps: tuple[int, ...] = ()
    replica_endpoint: str = ""
    # The rank's training uses a communicator a restarted process cannot rejoin (MindSpore's,
    # initialised by mindspore.communication.init()): a lost process restarts every worker.
    collectives: bool = False
    # The last step this process finished once past the start barrier (-1: not past it, as any new
    # process): a process that reconnects says how far it got, so a controller started again
    # (node 0 lost) knows the job was under way.
    progress: int = -1


@dataclass(frozen=True)
class RegisterAck:
    """Answer to Register: sent when every rank registered (start barrier) or at once on re-join."""

    KIND: ClassVar[str] = "register_ack"
    world_size: int
    endpoints: dict[int, str]
    state: JobState
    step: int = 0  # the step every rank has finished (the job's progress)
    cadence: tuple[int, ...] = ()  # the snapshot schedule, as in Cadence (empty: keep your own)


@dataclass(frozen=True)
class Heartbeat:
    """Liveness when nothing else flows: a rank sends one after an interval in which it sent,
    or heard, nothing else; the controller answers each with one of its own (rank=-1, ``step``
    the slowest rank's progress) and broadcasts none."""

    KIND: ClassVar[str] = "heartbeat"
    rank: int
    incarnation: int
    step: int


@dataclass(frozen=True)
class StepReport:
    """A rank finished ``step`` and started its snapshot (fire and forget: nobody answers).

    ``round`` is the last recovery round the rank took part in: a report sent before the
    rank saw a newer round's PAUSE is stale once that round rolls everyone back.
    """

    KIND: ClassVar[str] = "step_report"
    rank: int
    step: int
    round: int = 0


@dataclass(frozen=True)
class Progress:
    """Every rank has finished ``step``: a rank may now overwrite snapshots older than it."""

    KIND: ClassVar[str] = "progress"
    step: int


@dataclass(frozen=True)
class CostReport:
    """What protection costs this rank, smoothed over recent steps: seconds of training per
    step without snapshots, and seconds a snapshot costs the step (its copy, checksum and
    replica push, overlapped or not). Sent only when the figures move noticeably."""

    KIND: ClassVar[str] = "cost_report"
    rank: int
    step_time: float
    capture_time: float


@dataclass(frozen=True)
class Pace:
    """A rank's own work per step since its last Pace: the median ``seconds`` over ``steps`` steps, each
    from its start to its collectives (the whole step where it has none) (:mod:`mindft.flow.slow`)."""

    KIND: ClassVar[str] = "pace"
    rank: int
    steps: int
    seconds: float


@dataclass(frozen=True)
class Cadence:
    """The snapshot schedule every rank follows: ``schedule`` is start/every pairs (from step
    ``start`` on, every ``every``-th step is a capture step), the newest starting past any
    step a rank can have decided about when it was announced."""

    KIND: ClassVar[str] = "cadence"
    schedule: tuple[int, ...]


@dataclass(frozen=True)
class FaultReport:
    """A rank hit a fault inside ``step`` and is waiting for instructions. ``age``: seconds from
    the fault (the exception caught) to this report leaving the rank, on the rank's own clock
    (the job's clock is another host's: a duration crosses it, a time would not)."""

    KIND: ClassVar[str] = "fault_report"
    rank: int
    step: int
    kind: FaultKind
    detail: str = ""
    age: float = 0.0


@dataclass(frozen=True)
class Action:
    """An instruction from the controller.

    ``endpoints`` holds the replica endpoints that changed since the start barrier
    (a restarted rank has a new one); the processor merges them into its map.
    ``round`` numbers recoveries so late acknowledgements of an abandoned round are ignored.
    """

    KIND: ClassVar[str] = "action"
    kind: ActionKind
    step: int = -1
    reason: str = ""
    endpoints: dict[int, str] = field(default_factory=dict)
    fault: Optional[FaultKind] = None
    round: int = 0


@dataclass(frozen=True)
class Ack:
    """A rank finished an action (PAUSED / RESTORED / RESUMED) and holds ``held_steps``."""

    KIND: ClassVar[str] = "ack"
    rank: int
    action: ActionKind
    step: int
    held_steps: tuple[int, ...] = ()
    round: int = 0


@dataclass(frozen=True)
class AckBatch:
    """The acknowledgement of one action by several ranks of one node, relayed by its agent: what
    ``Ack(rank, action, step, held_steps, round)`` of each of ``ranks`` says (the ranks that hold
    the same steps: a node's ranks usually do)."""

    KIND: ClassVar[str] = "ack_batch"
    action: ActionKind
    step: int
    ranks: tuple[int, ...]
    held_steps: tuple[int, ...] = ()
    round: int = 0


@dataclass(frozen=True)
class StepBatch:
    """Several ranks' finished steps, relayed by their node agent: ``StepReport(ranks[i], steps[i], round)``
    each."""

    KIND: ClassVar[str] = "step_batch"
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    round: int = 0


@dataclass(frozen=True)
class Done:
    """A rank finished training at ``step``."""

    KIND: ClassVar[str] = "done"
    rank: int
    step: int


@dataclass(frozen=True)
class StatusRequest:
    """Ask the controller for a :class:`StatusReply` (``mindft status``)."""

    KIND: ClassVar[str] = "status_request"
    request_id: int = 0


@dataclass(frozen=True)
class RankStatus:
    """One row of a status reply (not a message on its own)."""

    rank: int
    state: RankState
    step: int
    last_heartbeat_age: float
    restarts: int
    pid: int
    incarnation: int = 0
    replica_endpoint: str = ""  # where a restarted rank's buddy serves its replica
    order: Optional[OrderKind] = None  # what the rank's node agent must still do for the recovery
    replicated: int = -1  # the newest step of this rank the buddy node's agent confirmed holding (-1: none)
    replica_lost: bool = False  # LOST PROTECTION: its replica is behind the steps every rank keeps (or its
    # agent says so), so a loss of its node now could not be recovered
    work_ratio: float = 0.0  # its own work per step over its peers' median in the newest window (0: not measured)
    slow: bool = False  # flagged slow (mindft.flow.slow)


@dataclass(frozen=True)
class StatusReply:
    """The controller's view: state, the step every rank finished, and every rank."""

    KIND: ClassVar[str] = "status_reply"
    state: JobState
    step: int
    ranks: tuple[RankStatus, ...] = ()
    reason: str = ""
    round: int = 0
    recoveries: int = 0
    request_id: int = 0
    restart_all: bool = False  # a lost process restarts every worker (the launchers wait for StartRank)
    snapshot_every: int = 1  # the snapshot cadence the job chose last (in force from its switch step)
    snapshot_cost: float = -1.0  # its slowdown by the slowest ranks' figures (0.01: 1%; -1: none reported yet)
    step_time: float = -1.0  # seconds per step, the slowest rank's smoothed figure (-1: none reported yet)
    overhead_budget: float = 0.0  # MINDFT_OVERHEAD_BUDGET; 0 when MINDFT_SNAPSHOT_EVERY fixes the cadence
    over_budget: bool = False  # even every MINDFT_MAX_REPLAY_STEPS steps, snapshots cost more than the budget
    waiting: str = ""  # who the current phase waits for, and why ("": nobody)
    deadline_in: float = -1.0  # seconds until the current phase times out (-1: no deadline)
    term: int = 0  # the controller's (0: node 0's first; a standby in command: higher)
    standbys: tuple[str, ...] = ()  # where the standby controllers listen, in takeover order ("": not heard yet)
    spares: int = 0  # warm spares waiting for a node
    standing_by: bool = False  # this controller is a standby that does not command yet
    wall_seconds: float = 0.0  # the job's time so far on the controller's clock (mindft.flow.goodput)
    productive_seconds: float = 0.0  # of which productive training
    badput: tuple[str, ...] = ()  # the rest, by bucket: names ...
    badput_seconds: tuple[float, ...] = ()  # ... and seconds, pairwise
    world_size: int = 0  # ranks in the job's world now
    nodes: int = 0  # nodes in the job's world now (0: not known yet)
    min_nodes: int = 0  # an elastic job's MIN:MAX nodes (0: not elastic)
    max_nodes: int = 0
    resizes: int = 0  # the job's changes of world size so far (mindft.flow.elastic)


@dataclass(frozen=True)
class DeviceEvent:
    """A device event forwarded by the launcher (same meaning as ``mindft.device.watch`` events)."""

    KIND: ClassVar[str] = "device_event"
    rank: int
    status: DeviceStatus
    error_code: str = ""
    policy: str = ""
    reason: str = ""
    request_id: int = 0


@dataclass(frozen=True)
class InjectRequest:
    """Ask the controller to make ``rank`` raise ``fault`` at its next step boundary."""

    KIND: ClassVar[str] = "inject_request"
    rank: int
    fault: FaultKind
    detail: str = ""
    request_id: int = 0


@dataclass(frozen=True)
class ProcessExit:
    """The launcher saw rank ``rank``'s process exit with ``returncode``."""

    KIND: ClassVar[str] = "process_exit"
    rank: int
    returncode: int
    pid: int = 0
    will_restart: bool = True  # False: no new incarnation will come, fail the job now
    request_id: int = 0


@dataclass(frozen=True)
class ReplicaReport:
    """A node agent's replicas of its ranks on the buddy node (or, ``node`` -1, a rank's own replica
    on its buddy rank): ``steps[i]`` is the newest step of ``ranks[i]`` the keeper confirmed holding
    (-1: none yet); ``lost`` lists the ranks whose replica fell behind (lost protection);
    ``cpu_seconds`` (a node agent's) is the CPU time the node's replication takes per snapshot of
    its ranks (sending theirs, keeping the buddy node's, in CurveZMQ's threads too): what a
    snapshot costs the node besides the ranks' captures, which the overhead budget counts. The
    controller answers with a :class:`Reply`."""

    KIND: ClassVar[str] = "replica_report"
    node: int
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    lost: tuple[int, ...] = ()
    cpu_seconds: float = 0.0
    request_id: int = 0


@dataclass(frozen=True)
class NodeLost:
    """A node agent's memory is gone: its node was lost and this is the agent of the node that
    replaced it (or the agent started again without it). ``ranks`` lost their processes and the
    snapshots the agent held for them; ``steps[i]`` is the step of ``ranks[i]``'s replica the new
    agent restored into its memory from the buddy node (-1: none could be restored), the only
    step that rank can roll back to. ``replicas_of`` lists the ranks whose replicas the lost node
    kept (they lost protection until their agent pushes again). Answered with a :class:`Reply`."""

    KIND: ClassVar[str] = "node_lost"
    node: int
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    replicas_of: tuple[int, ...] = ()
    reason: str = ""
    request_id: int = 0
    adoption: int = 0  # the spare's: the number of the AdoptNode it carries out (0: a launcher for the node)


@dataclass(frozen=True)
class AgentHello:
    """A node agent's link to the controller: ``ranks`` are the ranks whose processes it runs.

    Sent when the agent starts and every few seconds on the same connection; the controller
    answers each with a :class:`JobView` and the orders still pending for those ranks, and
    from then on sends the orders for those ranks (:class:`RankOrder`) to this connection.

    It also says what the agent runs and holds, so that a controller started again (node 0
    lost) can rebuild the job: per rank of ``ranks``, the pid of its process (0: none), that
    process's incarnation and the newest step of its snapshots in the agent's memory (-1: none);
    and the replicas its keeper (at ``keeper``) holds of other nodes' ranks: ``kept`` and
    ``kept_steps``, pairwise. No ``pids``: the agent says nothing of its ranks yet (it has not
    started them)."""

    KIND: ClassVar[str] = "agent_hello"
    node: int
    ranks: tuple[int, ...]
    pids: tuple[int, ...] = ()
    incarnations: tuple[int, ...] = ()
    newest: tuple[int, ...] = ()
    keeper: str = ""
    kept: tuple[int, ...] = ()
    kept_steps: tuple[int, ...] = ()
    spare: bool = False  # a warm spare (``mindft-launch --spare``): no ranks yet, ``node`` -1
    address: str = ""  # the host this agent's node is reached at (where its standby controller would listen)
    term: int = 0  # the newest controller term it knows


@dataclass(frozen=True)
class AdoptNode:
    """The controller gives lost node ``node`` to the spare it sends this to: the spare becomes
    that node's agent, restores its ranks' replicas from the next node's keeper and reports the node
    lost with ``adoption`` (:class:`NodeLost`), as a launcher started again for the node would."""

    KIND: ClassVar[str] = "adopt_node"
    node: int
    adoption: int
    reason: str = ""
    term: int = 0


@dataclass(frozen=True)
class Replaced:
    """Node ``node`` was given to another agent (a spare): the answer to a hello or a
    :class:`NodeLost` of an agent that is not that node's any more. It runs nothing of the job: it
    stops what it still runs and waits as a spare."""

    KIND: ClassVar[str] = "replaced"
    node: int
    reason: str = ""
    request_id: int = 0
    controller: str = ""  # where the job's controller is now ("": the one that answers)


@dataclass(frozen=True)
class Superseded:
    """A standby that took command of the job in ``term`` tells the controller it replaced (at that
    controller's address, again every few seconds: a node 0 that comes back hears it): the job is
    commanded at ``controller`` now. A controller of an older term stands down, and its node agent
    joins the job as a spare."""

    KIND: ClassVar[str] = "superseded"
    term: int
    controller: str


@dataclass(frozen=True)
class WorldResize:
    """The job goes on with the nodes ``members`` (their present numbers, in their new order: node
    ``members[i]`` is node ``i`` from now on, with ``nproc`` ranks each), commanded in ``term``
    (:mod:`mindft.flow.elastic`). Every node agent of the job stops its ranks, renumbers them and
    their memory, and says hello again; an agent not among the members waits as a spare. A spare
    told ``join`` becomes that node (numbered after the members)."""

    KIND: ClassVar[str] = "world_resize"
    term: int
    members: tuple[int, ...]
    nproc: int
    reason: str = ""
    join: int = -1  # to a spare the job grows by: the node it becomes (its ranks start from a peer's copy)
    nodes: int = 0  # nodes in the new world (0: the members alone)
    step: int = -1  # a growth's snapshot boundary: the agents stop their ranks once their memory holds it


@dataclass(frozen=True)
class JobView:
    """What a node agent needs of the job's state to decide about its processes: sent on every
    transition and in answer to :class:`AgentHello`. ``dump_step``: the step every rank dumps once
    the job FAILED (-1: each its newest). ``resetting``: ranks whose chip the device plugin is
    resetting (the controller starts them once it is back, however their process ended).
    ``exit_code``: the job's exit code whatever the ranks' (-1: from their codes), for a
    deterministic failure. ``unreached``: once FAILED, the ranks the job could not tell to dump
    (lost with their node, gone without a process, or never registered with this controller): the
    agents keeping their replicas write them. ``term``: the controller's (an agent refuses the views
    and orders of an older term); ``standbys``: where the standby controllers listen, in the order
    they take over (:mod:`mindft.flow.standby`)."""

    KIND: ClassVar[str] = "job_view"
    state: JobState
    restart_all: bool = False
    dump_step: int = -1
    reason: str = ""
    resetting: tuple[int, ...] = ()
    exit_code: int = -1
    unreached: tuple[int, ...] = ()
    term: int = 0
    standbys: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankOrder:
    """The controller orders the agent that runs ``rank`` to kill (``pid`` only: a newer process
    is left alone) or start its process (``pid``: the one that left, perhaps not yet seen
    exiting by the agent). ``restart`` (KILL): start it again at once (a hang) rather than wait
    for a START. ``restore_from`` (START): the keeper endpoint whose replica of the rank the agent
    puts into its memory first (its node was lost with the controller; "": its memory has it);
    ``restore_rank``: the rank whose state that is, when not the rank's own (-1): a node an elastic
    job grows by takes a copy of a data-parallel peer's state from that peer's agent."""

    KIND: ClassVar[str] = "rank_order"
    rank: int
    kind: OrderKind
    reason: str = ""
    pid: int = 0
    restart: bool = False
    restore_from: str = ""
    term: int = 0  # the controller's: an order of an older term is refused
    restore_rank: int = -1


@dataclass(frozen=True)
class Reply:
    """The controller's answer to InjectRequest, ProcessExit, DeviceEvent, ReplicaReport and NodeLost."""

    KIND: ClassVar[str] = "reply"
    ok: bool
    detail: str = ""
    request_id: int = 0


Message = Union[Register, RegisterAck, Heartbeat, StepReport, Progress, FaultReport, Action, Ack, AckBatch, StepBatch,
                Done,
                StatusRequest, StatusReply, DeviceEvent, InjectRequest, ProcessExit, ReplicaReport, NodeLost, Reply,
                CostReport, Pace, Cadence, AgentHello, JobView, RankOrder, AdoptNode, Replaced, Superseded,
                WorldResize]
