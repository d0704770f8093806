"""One frame per message: :func:`encode` and :func:`decode`, and the hot path for the frames the
controller receives by the thousand."""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import typing
from typing import Any, Mapping, Optional, Union

from mindft.protocol.messages import (Ack, AckBatch, ActionKind, Heartbeat, MAX_FRAME, Message, PROTOCOL_VERSION,
                                      ProtocolError, RankStatus, StepBatch, StepReport)


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
_INTS: dict[bytes, tuple[int, ...]] = {}  # integer lists as sent, each checked once → tuple (see _ints)
# A list's pattern only bounds its characters: a list is checked against the strict one on first
# sight (_ints), then found in the cache. The loose scan costs half the strict one per frame, and
# a node's rank lists come back every phase.
_INT_LIST = re.compile(rb"(?:%s(?:,%s)*)?" % (_INT, _INT))


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


def _ints(text: bytes) -> Optional[tuple[int, ...]]:
    """A list of integers as sent → tuple (None: not spelled as encode() writes it), from a cache: a
    node's ranks and the steps they hold come again phase after phase."""
    ints = _INTS.get(text)
    if ints is None:
        if _INT_LIST.fullmatch(text) is None:
            return None
        ints = tuple(map(int, text.split(b","))) if text else ()
        if len(_INTS) >= 65536:
            _INTS.clear()
        _INTS[text] = ints
    return ints


def _hot_ack(fields: tuple[bytes, ...]) -> Optional[Ack]:
    rank, action, step, held_text, round_ = fields
    kind = _ACTION_BY_WIRE.get(action)
    if kind is None:
        return None  # the full path names the valid actions
    held = _ints(held_text)
    if held is None:
        return None
    message = _new(Ack)
    values = message.__dict__
    values["rank"], values["action"], values["step"] = int(rank), kind, int(step)
    values["held_steps"], values["round"] = held, int(round_)
    return message


def _hot_ack_batch(fields: tuple[bytes, ...]) -> Optional[AckBatch]:
    action, step, ranks, held_text, round_ = fields
    kind, ranks, held = _ACTION_BY_WIRE.get(action), _ints(ranks), _ints(held_text)
    if kind is None or ranks is None or held is None:
        return None
    message = _new(AckBatch)
    values = message.__dict__
    values["action"], values["step"], values["ranks"] = kind, int(step), ranks
    values["held_steps"], values["round"] = held, int(round_)
    return message


def _hot_step_batch(fields: tuple[bytes, ...]) -> Optional[StepBatch]:
    ranks, steps = _ints(fields[0]), _ints(fields[1])
    if ranks is None or steps is None:
        return None
    message = _new(StepBatch)
    values = message.__dict__
    values["ranks"], values["steps"], values["round"] = ranks, steps, int(fields[2])
    return message


_LIST = rb"([-0-9,]*)"  # spelled as _INT_LIST says: see _ints
_HOT: dict[bytes, tuple[Any, Any]] = {  # the first 6 bytes of the kind → (whole-frame pattern, builder)
    b'step_r': (re.compile(re.escape(_HOT_HEAD) + rb'step_report","rank":(%s),"step":(%s),"round":(%s)\}'
                           % (_INT, _INT, _INT)), _hot_step_report),
    b'heartb': (re.compile(re.escape(_HOT_HEAD) + rb'heartbeat","rank":(%s),"incarnation":(%s),"step":(%s)\}'
                           % (_INT, _INT, _INT)), _hot_heartbeat),
    b'ack","': (re.compile(re.escape(_HOT_HEAD) + rb'ack","rank":(%s),"action":"([a-z_]{1,32})","step":(%s),'
                           rb'"held_steps":\[%s\],"round":(%s)\}' % (_INT, _INT, _LIST, _INT)), _hot_ack),
    # A relay's, one per node per phase and per step (hundreds of ranks at most: within the hot size).
    b'ack_ba': (re.compile(re.escape(_HOT_HEAD) + rb'ack_batch","action":"([a-z_]{1,32})","step":(%s),'
                           rb'"ranks":\[%s\],"held_steps":\[%s\],"round":(%s)\}' % (_INT, _LIST, _LIST, _INT)),
                _hot_ack_batch),
    b'step_b': (re.compile(re.escape(_HOT_HEAD) + rb'step_batch","ranks":\[%s\],"steps":\[%s\],"round":(%s)\}'
                           % (_LIST, _LIST, _INT)), _hot_step_batch),
}


def decode(frame: bytes) -> Message:
    """Parse and validate one frame; raise :class:`ProtocolError` with the reason if it is bad."""
    if type(frame) is bytes and len(frame) <= 4096:
        hot = _HOT.get(frame[_HOT_AT:_HOT_AT + 6])
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


def _float_tuple(value: Any, where: str, name: str) -> tuple[float, ...]:
    if type(value) is not list or any(type(v) not in (int, float) or not math.isfinite(v) for v in value):
        raise _bad(where, name, "a list of finite numbers", value)
    return tuple(float(v) for v in value)


def _str_tuple(value: Any, where: str, name: str) -> tuple[str, ...]:
    if type(value) is not list or any(type(v) is not str for v in value):
        raise _bad(where, name, "a list of strings", value)
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
              tuple[str, ...]: _str_tuple, tuple[float, ...]: _float_tuple,
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
