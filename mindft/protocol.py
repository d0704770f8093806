"""Wire messages between the controller, the per-rank processors, the launcher and the CLI.

Every message is a frozen dataclass with a ``KIND`` class constant (the message type;
``Action.kind`` and ``FaultReport.kind`` are the action and fault kinds). A frame is one
UTF-8 JSON object ``{"v": PROTOCOL_VERSION, "msg": KIND, <fields>}``; :func:`encode`
and :func:`decode` are the only way in and out. :func:`decode` validates the version,
the kind, the size and every field's type, and raises :class:`ProtocolError` (never
anything else) so a receiver can log the reason and drop the frame.

:func:`encode` writes fields in declaration order without spaces (the per-step
:class:`StepReport` and :class:`Heartbeat` from byte templates). :func:`decode` recognises the
frames the controller receives by the thousand (step reports, heartbeats, acks) in exactly
that spelling without parsing JSON; any other spelling of the same message takes the full path
to the same result.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional, Union

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
PROTOCOL_VERSION = 7
# Large enough for an endpoint map of ~20k ranks; bigger frames are refused unread.
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
    """Device events the launcher can forward over the wire (see ``mindft.resetwatch``)."""

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
class Cadence:
    """The snapshot schedule every rank follows: ``schedule`` is start/every pairs (from step
    ``start`` on, every ``every``-th step is a capture step), the newest starting past any
    step a rank can have decided about when it was announced."""

    KIND: ClassVar[str] = "cadence"
    schedule: tuple[int, ...]


@dataclass(frozen=True)
class FaultReport:
    """A rank hit a fault inside ``step`` and is waiting for instructions."""

    KIND: ClassVar[str] = "fault_report"
    rank: int
    step: int
    kind: FaultKind
    detail: str = ""


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
    overhead_budget: float = 0.0  # MINDFT_OVERHEAD_BUDGET; 0 when MINDFT_SNAPSHOT_EVERY fixes the cadence
    over_budget: bool = False  # even every MINDFT_MAX_REPLAY_STEPS steps, snapshots cost more than the budget
    waiting: str = ""  # who the current phase waits for, and why ("": nobody)
    deadline_in: float = -1.0  # seconds until the current phase times out (-1: no deadline)


@dataclass(frozen=True)
class DeviceEvent:
    """A device event forwarded by the launcher (same meaning as ``mindft.resetwatch`` events)."""

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


@dataclass(frozen=True)
class AgentHello:
    """A node agent's link to the controller: ``ranks`` are the ranks whose processes it runs.

    Sent when the agent starts and every few seconds on the same connection; the controller
    answers each with a :class:`JobView` and the orders still pending for those ranks, and
    from then on sends the orders for those ranks (:class:`RankOrder`) to this connection."""

    KIND: ClassVar[str] = "agent_hello"
    node: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class JobView:
    """What a node agent needs of the job's state to decide about its processes: sent on every
    transition and in answer to :class:`AgentHello`. ``dump_step``: the step every rank dumps once
    the job FAILED (-1: each its newest)."""

    KIND: ClassVar[str] = "job_view"
    state: JobState
    restart_all: bool = False
    dump_step: int = -1
    reason: str = ""


@dataclass(frozen=True)
class RankOrder:
    """The controller orders the agent that runs ``rank`` to kill (``pid`` only: a newer process
    is left alone) or start its process. ``restart`` (KILL): start it again at once (a hang)
    rather than wait for a START."""

    KIND: ClassVar[str] = "rank_order"
    rank: int
    kind: OrderKind
    reason: str = ""
    pid: int = 0
    restart: bool = False


@dataclass(frozen=True)
class Reply:
    """The controller's answer to InjectRequest, ProcessExit, DeviceEvent, ReplicaReport and NodeLost."""

    KIND: ClassVar[str] = "reply"
    ok: bool
    detail: str = ""
    request_id: int = 0


Message = Union[Register, RegisterAck, Heartbeat, StepReport, Progress, FaultReport, Action, Ack, Done,
                StatusRequest, StatusReply, DeviceEvent, InjectRequest, ProcessExit, ReplicaReport, NodeLost, Reply,
                CostReport, Cadence, AgentHello, JobView, RankOrder]

MESSAGE_TYPES: tuple[type, ...] = typing.get_args(Message)
_BY_KIND: dict[str, type] = {cls.KIND: cls for cls in MESSAGE_TYPES}
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_DECODER = json.JSONDecoder()


def encode(message: Message) -> bytes:
    """Serialize one message into one frame."""
    cls = type(message)
    if cls is StepReport:
        return _STEP_REPORT % (message.rank, message.step, message.round)
    if cls is Heartbeat:
        return _HEARTBEAT % (message.rank, message.incarnation, message.step)
    fields = _FIELDS.get(cls)
    if fields is None or cls is RankStatus:
        raise ProtocolError(f"cannot encode {cls.__name__}: not a mindft message")
    body: dict[str, Any] = {"v": PROTOCOL_VERSION, "msg": message.KIND}
    for name, _, _ in fields:
        body[name] = _plain(getattr(message, name))
    frame = _ENCODER.encode(body).encode()
    if len(frame) > MAX_FRAME:
        raise ProtocolError(f"{message.KIND} frame of {len(frame)} bytes exceeds MAX_FRAME={MAX_FRAME}")
    return frame


def encode_step_report(rank: int, step: int, round: int) -> bytes:
    """``encode(StepReport(rank, step, round))``, built from a template: the per-step hot path."""
    return _STEP_REPORT % (rank, step, round)


def encode_heartbeat(rank: int, incarnation: int, step: int) -> bytes:
    """``encode(Heartbeat(rank, incarnation, step))``, built from a template."""
    return _HEARTBEAT % (rank, incarnation, step)


_STEP_REPORT = b'{"v":%d,"msg":"step_report","rank":%%d,"step":%%d,"round":%%d}' % PROTOCOL_VERSION
_HEARTBEAT = b'{"v":%d,"msg":"heartbeat","rank":%%d,"incarnation":%%d,"step":%%d}' % PROTOCOL_VERSION
# The frames the controller receives by the thousand (step reports, heartbeats, acks), as
# patterns of exactly the bytes encode() writes, each integer spelled the one way JSON allows:
# a frame that matches is the message the full decoder would build from it, so it skips
# json.loads and the per-field checks. Any other spelling takes the full path. The message
# kind sits at a fixed offset, so one dictionary lookup picks the one pattern to try.
_INT = rb"-?(?:0|[1-9][0-9]{0,17})"
_HOT_HEAD = b'{"v":%d,"msg":"' % PROTOCOL_VERSION
_HOT_AT = len(_HOT_HEAD)
_ACTION_BY_WIRE = {kind.value.encode(): kind for kind in ActionKind}
_HELD: dict[bytes, tuple[int, ...]] = {}  # held_steps as sent → tuple: ranks mostly hold the same steps


# The hot messages are built from values the patterns already checked without the frozen
# dataclass __init__ (one object.__setattr__ per field, half an ack's decode): the same
# fields in the same instance dictionary.
_new = object.__new__


def _hot_step_report(fields: tuple[bytes, ...]) -> StepReport:
    rank, step, round_ = fields
    message = _new(StepReport)
    values = message.__dict__
    values["rank"], values["step"], values["round"] = int(rank), int(step), int(round_)
    return message


def _hot_heartbeat(fields: tuple[bytes, ...]) -> Heartbeat:
    rank, incarnation, step = fields
    message = _new(Heartbeat)
    values = message.__dict__
    values["rank"], values["incarnation"], values["step"] = int(rank), int(incarnation), int(step)
    return message


def _hot_ack(fields: tuple[bytes, ...]) -> Optional[Ack]:
    rank, action, step, held_text, round_ = fields
    kind = _ACTION_BY_WIRE.get(action)
    if kind is None:
        return None  # the full path names the valid actions
    held = _HELD.get(held_text)
    if held is None:
        held = tuple(map(int, held_text.split(b","))) if held_text else ()
        if len(_HELD) >= 256:
            _HELD.clear()
        _HELD[held_text] = held
    message = _new(Ack)
    values = message.__dict__
    values["rank"], values["action"], values["step"] = int(rank), kind, int(step)
    values["held_steps"], values["round"] = held, int(round_)
    return message


_HOT: dict[bytes, tuple[Any, Any]] = {  # the first 3 bytes of the kind → (whole-frame pattern, builder)
    b"ste": (re.compile(re.escape(_HOT_HEAD) + rb'step_report","rank":(%s),"step":(%s),"round":(%s)\}'
                        % (_INT, _INT, _INT)), _hot_step_report),
    b"hea": (re.compile(re.escape(_HOT_HEAD) + rb'heartbeat","rank":(%s),"incarnation":(%s),"step":(%s)\}'
                        % (_INT, _INT, _INT)), _hot_heartbeat),
    b"ack": (re.compile(re.escape(_HOT_HEAD) + rb'ack","rank":(%s),"action":"([a-z_]{1,32})","step":(%s),'
                        rb'"held_steps":\[((?:%s(?:,%s)*)?)\],"round":(%s)\}' % (_INT, _INT, _INT, _INT, _INT)),
             _hot_ack),
}


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; raise :class:`ProtocolError` with the reason if it is bad."""
    if type(frame) is bytes and len(frame) <= 512:
        hot = _HOT.get(frame[_HOT_AT:_HOT_AT + 3])
        if hot is not None:
            fields = hot[0].fullmatch(frame)
            message = None if fields is None else hot[1](fields.groups())
            if message is not None:
                return message
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds MAX_FRAME={MAX_FRAME}")
    try:
        body = _DECODER.decode(bytes(frame).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ProtocolError(f"frame is not JSON ({_short(error)}): {_preview(frame)}") from None
    if type(body) is not dict:
        raise ProtocolError(f"frame is not a JSON object: {_preview(frame)}")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolError(f"unsupported protocol version {version!r}; this side speaks "
                            f"{PROTOCOL_VERSION} (are all processes running the same mindft?)")
    kind = body.pop("msg", None)
    cls = _BY_KIND.get(kind) if type(kind) is str else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}; known: {', '.join(sorted(_BY_KIND))}")
    return _build(cls, body, kind)


def _build(cls: type, body: dict[str, Any], where: str) -> Any:
    fields = _FIELDS[cls]
    if len(body) > len(fields) or not body.keys() <= _NAMES[cls]:
        unknown = set(body) - _NAMES[cls]
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
    values = {}
    for name, convert, required in fields:
        if name in body:
            values[name] = convert(body[name], where, name)
        elif required:
            raise ProtocolError(f"{where}: missing field {name!r}")
    return cls(**values)


def _bad(where: str, name: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(f"{where}.{name}: expected {expected}, got {_preview(value)}")


def _int(value: Any, where: str, name: str) -> int:
    if type(value) is not int:
        raise _bad(where, name, "an integer", value)
    return value


def _str(value: Any, where: str, name: str) -> str:
    if type(value) is not str:
        raise _bad(where, name, "a string", value)
    return value


def _bool(value: Any, where: str, name: str) -> bool:
    if type(value) is not bool:
        raise _bad(where, name, "a boolean", value)
    return value


def _float(value: Any, where: str, name: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):  # JSON's decoder takes NaN and Infinity
        raise _bad(where, name, "a finite number", value)
    return float(value)


def _int_tuple(value: Any, where: str, name: str) -> tuple[int, ...]:
    if type(value) is not list or any(type(v) is not int for v in value):
        raise _bad(where, name, "a list of integers", value)
    return tuple(value)


def _endpoint_map(value: Any, where: str, name: str) -> dict[int, str]:
    if type(value) is not dict:
        raise _bad(where, name, "an object of rank → endpoint", value)
    try:
        result = {int(k): v for k, v in value.items()}
    except ValueError:
        raise _bad(where, name, "integer rank keys", value) from None
    if any(type(v) is not str for v in result.values()):
        raise _bad(where, name, "string endpoints", value)
    return result


def _status_rows(value: Any, where: str, name: str) -> tuple[RankStatus, ...]:
    if type(value) is not list or any(type(v) is not dict for v in value):
        raise _bad(where, name, "a list of rank objects", value)
    return tuple(_build(RankStatus, dict(v), f"{where}.{name}[{i}]") for i, v in enumerate(value))


def _enum(cls: type[enum.Enum]) -> Any:
    members = {m.value: m for m in cls}
    names = ", ".join(members)

    def convert(value: Any, where: str, name: str) -> Any:
        member = members.get(value) if type(value) is str else None
        if member is None:
            raise ProtocolError(f"{where}.{name}: {_preview(value)} is not one of {names}")
        return member
    return convert


def _optional(inner: Any) -> Any:
    def convert(value: Any, where: str, name: str) -> Any:
        return None if value is None else inner(value, where, name)
    return convert


def _converter(hint: Any) -> Any:
    if typing.get_origin(hint) is Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _optional(_converter(inner[0]))
    simple = {int: _int, str: _str, bool: _bool, float: _float, tuple[int, ...]: _int_tuple,
              dict[int, str]: _endpoint_map, tuple[RankStatus, ...]: _status_rows}
    if hint in simple:
        return simple[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum(hint)
    raise TypeError(f"no wire converter for {hint!r}")  # a programming error in this module


def _field_table(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _converter(hints[f.name]),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {
    cls: _field_table(cls) for cls in (*MESSAGE_TYPES, RankStatus)}
_NAMES: dict[type, frozenset[str]] = {cls: frozenset(f[0] for f in fields) for cls, fields in _FIELDS.items()}


def _plain(value: Any) -> Any:
    kind = type(value)
    if kind in (int, str, bool, float) or value is None:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if kind in (tuple, list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if kind is RankStatus:
        return {name: _plain(getattr(value, name)) for name, _, _ in _FIELDS[RankStatus]}
    raise ProtocolError(f"cannot encode a {kind.__name__} value")


def _preview(value: Any, limit: int = 60) -> str:
    text = repr(bytes(value[:limit]) if isinstance(value, (bytes, bytearray, memoryview)) else value)
    return text if len(text) <= limit else text[:limit] + "..."


def _short(error: Exception) -> str:
    return str(error).split("\n")[0][:80]
