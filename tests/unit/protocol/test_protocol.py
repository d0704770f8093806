"""Wire messages: every message round-trips; every kind of bad frame is a ProtocolError."""
from __future__ import annotations

import dataclasses
import json

import pytest

from mindft import protocol
from mindft.protocol import (MAX_FRAME, MESSAGE_TYPES, PROTOCOL_VERSION, Ack, Action, ActionKind, AdoptNode,
                             AgentHello, JobState, JobView, OrderKind, RankOrder, RankState, Cadence, CostReport,
                             DeviceEvent, DeviceStatus, Done, FaultKind, FaultReport, Heartbeat, InjectRequest,
                             NodeLost, Pace, ProcessExit, ProtocolError, RankStatus, Register, Progress, RegisterAck,
                             Replaced, ReplicaReport, Superseded, WorldResize, Reply, StatusReply, StatusRequest, StepReport,
                             AckBatch, StepBatch,
                             decode, encode)

SAMPLES = [
    Register(rank=3, incarnation=2, pid=4242, held_steps=(7, 8), replica_endpoint="tcp://127.0.0.1:5000"),
    Register(rank=0, incarnation=0, pid=1),
    RegisterAck(world_size=2, endpoints={0: "tcp://a:1", 1: "tcp://b:2"}, state="NORMAL", step=5),
    Heartbeat(rank=-1, incarnation=0, step=-1),
    StepReport(rank=1, step=9),
    Progress(step=8),
    FaultReport(rank=2, step=10, kind=FaultKind.UCE, detail="0x80E01801 on device 2"),
    Action(kind=ActionKind.ROLLBACK, step=8, reason="", endpoints={3: "tcp://c:3"}, round=4),
    Action(kind=ActionKind.INJECT_FAULT, step=1, fault=FaultKind.DEVICE_RESET),
    Action(kind=ActionKind.DUMP_AND_EXIT, reason="PAUSING timed out ✗"),
    Action(kind=ActionKind.FINISH, step=100, round=1),
    Ack(rank=0, action=ActionKind.PAUSE, step=8, held_steps=(7, 8), round=4),
    Done(rank=1, step=100),
    StatusRequest(),
    StatusRequest(request_id=12345),
    StatusReply(state=JobState.REPAIRING, step=8,
                ranks=(RankStatus(0, RankState.PAUSED, 8, 0.25, 0, 11),
                       RankStatus(1, RankState.DEAD, 9, 3.5, 1, 12, incarnation=1, order=OrderKind.START,
                                  replicated=7, replica_lost=True, work_ratio=1.52, slow=True)),
                reason="rank 1 HANG at step 9", round=2, recoveries=1, request_id=12345,
                waiting="rank 1 (not re-registered)", deadline_in=12.5),
    DeviceEvent(rank=1, status=DeviceStatus.FAULTY, error_code="0x80E01801", policy="reset"),
    InjectRequest(rank=0, fault=FaultKind.COMMUNICATION, detail="test"),
    ProcessExit(rank=1, returncode=-9, pid=77, will_restart=False, request_id=3),
    Reply(ok=False, detail="no rank 9"),
    RegisterAck(world_size=1, endpoints={}, state=JobState.STARTING, cadence=(0, 1, 12, 4)),
    AgentHello(node=1, ranks=(2, 3)),
    JobView(state=JobState.FAILED, restart_all=True, dump_step=8, reason="PAUSING timed out"),
    RankOrder(rank=3, kind=OrderKind.KILL, reason="HANG", pid=77, restart=True),
    RankOrder(rank=2, kind=OrderKind.START),
    CostReport(rank=2, step_time=0.142, capture_time=0.025),
    CostReport(rank=0, step_time=1, capture_time=0),
    Pace(rank=3, steps=41, seconds=2.05),
    Cadence(schedule=(0, 1, 30, 18)),
    ReplicaReport(node=1, ranks=(2, 3), steps=(8, -1), lost=(3,), request_id=9),
    NodeLost(node=1, ranks=(2, 3), steps=(8, -1), replicas_of=(0, 1), reason="new node", request_id=10),
    NodeLost(node=2, ranks=(4,), steps=(6,), adoption=3),
    AgentHello(node=-1, ranks=(), spare=True),
    AdoptNode(node=1, adoption=1, reason="node 1's agent and ranks [1] silent for 6.2 s"),
    Replaced(node=1, reason="node 1 was given to a spare", request_id=11),
    Replaced(node=0, reason="stands down", controller="tcp://10.0.0.2:29601"),
    Superseded(term=1, controller="tcp://10.0.0.2:29601"),
    WorldResize(term=1, members=(0, 2), nproc=1, reason="node 1 lost for good"),
    AckBatch(ActionKind.PAUSE, 7, ranks=(8, 9, 10), held_steps=(6, 4), round=2),
    StepBatch(ranks=(8, 9), steps=(12, 13), round=2),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message) -> None:
    frame = encode(message)
    assert isinstance(frame, bytes)
    decoded = decode(frame)
    assert decoded == message
    assert type(decoded) is type(message)


def test_every_message_type_is_covered_and_has_a_unique_kind() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)
    kinds = [cls.KIND for cls in MESSAGE_TYPES]
    assert len(kinds) == len(set(kinds))


def test_frames_carry_version_and_kind() -> None:
    body = json.loads(encode(Done(rank=1, step=2)))
    assert body["v"] == PROTOCOL_VERSION and body["msg"] == "done"


def test_messages_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Done(rank=1, step=2).step = 3


def test_decoded_enums_are_enums_and_endpoint_keys_are_ints() -> None:
    action = decode(encode(Action(kind=ActionKind.RESUME, step=3, endpoints={12: "x"})))
    assert action.kind is ActionKind.RESUME
    assert list(action.endpoints) == [12]
    ack = decode(encode(Ack(rank=0, action=ActionKind.PAUSE, step=1, held_steps=(0, 1))))
    assert ack.held_steps == (0, 1) and isinstance(ack.held_steps, tuple)


def frame(**body) -> bytes:
    return json.dumps(body).encode()


BAD_FRAMES = {
    "binary garbage": b"\xff\xfe\x00garbage",
    "empty": b"",
    "truncated json": b'{"v":1,"msg":"done","rank":1',
    "json list": b"[1,2,3]",
    "json string": b'"done"',
    "no version": frame(msg="done", rank=1, step=2),
    "future version": frame(v=PROTOCOL_VERSION + 1, msg="done", rank=1, step=2),
    "version as string": frame(v=str(PROTOCOL_VERSION), msg="done", rank=1, step=2),
    "unknown kind": frame(v=PROTOCOL_VERSION, msg="launch_missiles"),
    "kind not a string": frame(v=PROTOCOL_VERSION, msg=7),
    "no kind": frame(v=PROTOCOL_VERSION, rank=1),
    "missing field": frame(v=PROTOCOL_VERSION, msg="done", rank=1),
    "unknown field": frame(v=PROTOCOL_VERSION, msg="done", rank=1, step=2, evil=True),
    "string for int": frame(v=PROTOCOL_VERSION, msg="done", rank="1", step=2),
    "bool for int": frame(v=PROTOCOL_VERSION, msg="done", rank=True, step=2),
    "float for int": frame(v=PROTOCOL_VERSION, msg="done", rank=1.5, step=2),
    "unknown fault kind": frame(v=PROTOCOL_VERSION, msg="fault_report", rank=1, step=2, kind="meteor"),
    "unknown action": frame(v=PROTOCOL_VERSION, msg="action", kind="self_destruct"),
    "held_steps not a list": frame(v=PROTOCOL_VERSION, msg="ack", rank=1, action="pause", step=1,
                                   held_steps=5),
    "held_steps with strings": frame(v=PROTOCOL_VERSION, msg="ack", rank=1, action="pause", step=1,
                                     held_steps=["a"]),
    "endpoint keys not ranks": frame(v=PROTOCOL_VERSION, msg="register_ack", world_size=1,
                                     endpoints={"zero": "x"}, state="NORMAL"),
    "endpoint values not strings": frame(v=PROTOCOL_VERSION, msg="register_ack", world_size=1,
                                         endpoints={"0": 5}, state="NORMAL"),
    "float cadence": frame(v=PROTOCOL_VERSION, msg="cadence", schedule=[0, 1.5]),
    "string step time": frame(v=PROTOCOL_VERSION, msg="cost_report", rank=0, step_time="fast", capture_time=0.1),
    "bad nested status": frame(v=PROTOCOL_VERSION, msg="status_reply", state="NORMAL", step=1,
                               ranks=[{"rank": 0}]),
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_bad_frames_are_rejected_with_a_reason(name: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(BAD_FRAMES[name])
    assert str(info.value)


def test_oversized_frame_is_rejected_without_parsing() -> None:
    big = frame(v=PROTOCOL_VERSION, msg="reply", ok=True, detail="x" * MAX_FRAME)
    with pytest.raises(ProtocolError, match="MAX_FRAME"):
        decode(big)
    with pytest.raises(ProtocolError, match="MAX_FRAME"):
        encode(Reply(ok=True, detail="x" * MAX_FRAME))


def test_non_bytes_and_non_messages_are_rejected() -> None:
    with pytest.raises(ProtocolError):
        decode("a str")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError):
        encode(RankStatus(0, "running", 1, 0.0, 0, 1))  # a part, not a message


def test_version_error_names_both_versions() -> None:
    with pytest.raises(ProtocolError, match=f"version 99.*speaks {PROTOCOL_VERSION}"):
        decode(frame(v=99, msg="done", rank=1, step=2))


def test_enum_values_are_stable_wire_names() -> None:
    # These strings are the wire format: changing one is a protocol version bump.
    assert [k.value for k in FaultKind] == ["device_reset", "uce", "communication", "process_died",
                                            "hang", "scheduler_lost", "user_error", "unknown"]
    assert [k.value for k in ActionKind] == ["pause", "rollback", "resume", "dump_and_exit",
                                             "inject_fault", "finish", "leave_device"]
    assert [k.value for k in OrderKind] == ["kill", "start"]
    assert [k.value for k in JobState] == ["STARTING", "NORMAL", "PAUSING", "REPAIRING", "ROLLBACK", "RESUMING",
                                           "FAILED", "DONE"]
    assert [k.value for k in RankState] == ["registered", "running", "faulty", "dead", "off_device", "lost",
                                            "paused", "restored", "resumed", "done"]
    assert protocol.PROTOCOL_VERSION == 15


def test_wire_enums_print_as_their_values() -> None:
    # Status tables and log lines show the wire name, as before the states were enums.
    assert f"{JobState.NORMAL}" == str(JobState.NORMAL) == "NORMAL"
    assert f"{RankState.OFF_DEVICE:>12}" == "  off_device"


@pytest.mark.parametrize("rank, step, round_", [(0, 0, 0), (3, 123456789, 2), (16383, 1, 99)])
def test_the_step_report_template_is_what_encode_writes(rank: int, step: int, round_: int) -> None:
    message = protocol.StepReport(rank, step, round_)
    assert protocol.encode_step_report(rank, step, round_) == encode(message)
    assert decode(protocol.encode_step_report(rank, step, round_)) == message


@pytest.mark.parametrize("message", [protocol.Heartbeat(-1, 0, 7), protocol.Heartbeat(16383, 2, 123456789),
                                     protocol.StepReport(5, 6, 7), Ack(3, ActionKind.PAUSE, 4, (3, 4), 2),
                                     Ack(0, ActionKind.RESUME, -1, (), 0), Ack(9, ActionKind.ROLLBACK, 0, (0,), 1),
                                     AckBatch(ActionKind.PAUSE, 3, tuple(range(64, 72)), (2, 3), 5),
                                     StepBatch((8, 9, 10), (4, 4, 5), 1), StepBatch((), (), 0)])
def test_hot_frames_are_decoded_without_json(message, monkeypatch: pytest.MonkeyPatch) -> None:
    frame = encode(message)
    if isinstance(message, protocol.Heartbeat):
        assert frame == protocol.encode_heartbeat(message.rank, message.incarnation, message.step)

    class NoJson:
        def decode(self, text: str) -> None:
            raise AssertionError(f"the full JSON path was taken for {text}")
    monkeypatch.setattr(protocol.codec, "_DECODER", NoJson())
    decoded = decode(frame)
    # Built without the dataclass __init__: still the same fields, hash and immutability.
    assert decoded == message and vars(decoded) == vars(message) and hash(decoded) == hash(message)
    assert type(decoded) is type(message) and all(type(getattr(decoded, name)) is int
                                                  for name in ("rank", "step", "round") if hasattr(message, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.rank = 1  # type: ignore[misc]


@pytest.mark.parametrize("text, error", [
    ('{"v":15,"msg":"heartbeat","rank":1,"incarnation":0,"step":01}', "not JSON"),  # JSON has no leading zeros
    ('{"v":15,"msg":"heartbeat","rank":1,"incarnation":0,"step":1,"x":2}', "unknown field"),
    ('{"v":15,"msg":"heartbeat","rank":1,"incarnation":0}', "missing field 'step'"),
    ('{"v":15,"msg":"step_report","rank":1,"step":1.5,"round":0}', "expected an integer"),
    ('{"v":15,"msg":"step_report","rank":1,"step":true,"round":0}', "expected an integer"),
    ('{"v":15,"msg":"cost_report","rank":1,"step_time":NaN,"capture_time":0.1}', "expected a finite number"),
    ('{"v":15,"msg":"replica_report","node":0,"ranks":[0],"steps":[1],"cpu_seconds":-Infinity}',
     "expected a finite number"),
    ('{"v":2,"msg":"step_report","rank":1,"step":1,"round":0}', "unsupported protocol version 2"),
    ('{"v":15,"msg":"ack","rank":1,"action":"self_destruct","step":1,"held_steps":[1],"round":1}',
     "not one of pause, rollback"),
    ('{"v":15,"msg":"ack","rank":1,"action":"pause","step":1,"held_steps":[1,"2"],"round":1}', "a list of integers"),
    ('{"v":15,"msg":"ack","rank":1,"action":"pause","step":1,"held_steps":[1,],"round":1}', "not JSON"),
    ('{"v":15,"msg":"ack_batch","action":"sleep","step":1,"ranks":[1],"held_steps":[1],"round":1}',
     "not one of pause, rollback"),
    ('{"v":15,"msg":"ack_batch","action":"pause","step":1,"ranks":[1,"2"],"held_steps":[1],"round":1}',
     "a list of integers"),
    ('{"v":15,"msg":"step_batch","ranks":[1,2],"steps":[3,4.5],"round":0}', "a list of integers"),
    # A list's pattern only bounds its characters: each list is checked strictly before it is cached.
    ('{"v":15,"msg":"ack_batch","action":"pause","step":1,"ranks":[1,02],"held_steps":[1],"round":1}', "not JSON"),
    ('{"v":15,"msg":"ack_batch","action":"pause","step":1,"ranks":[1,2],"held_steps":[1,,2],"round":1}', "not JSON"),
    ('{"v":15,"msg":"step_batch","ranks":[1,-],"steps":[3,4],"round":0}', "not JSON"),
    ('{"v":15,"msg":"ack","rank":1,"action":"pause","step":1,"held_steps":[--1],"round":1}', "not JSON"),
    ('{"v":15,"msg":"step_batch","ranks":[1,2],"steps":[3,4],"round":0,"node":1}', "unknown field"),
])
def test_near_misses_of_the_hot_templates_get_the_full_checks(text: str, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        decode(text.encode())


@pytest.mark.parametrize("text, message", [
    ('{"msg":"heartbeat","v":15,"rank":1,"incarnation":0,"step":2}', protocol.Heartbeat(1, 0, 2)),
    ('{"v":15,"msg":"step_report","rank":1,"step":2}', protocol.StepReport(1, 2, 0)),
    ('{"v":15,"msg":"ack","rank":1,"action":"pause","step":1,"held_steps":[0, 1],"round":1}',
     Ack(1, ActionKind.PAUSE, 1, (0, 1), 1)),
    ('{"v": 15, "msg": "step_report", "rank": -0, "step": 12345678901234567890123, "round": 1}',
     protocol.StepReport(0, 12345678901234567890123, 1)),
    ('{"v":15,"msg":"ack_batch","action":"resume","step":4,"ranks":[8, 9],"held_steps":[],"round":2}',
     AckBatch(ActionKind.RESUME, 4, (8, 9), (), 2)),
    ('{"v":15,"msg":"step_batch","round":2,"ranks":[8,9],"steps":[5,6]}', StepBatch((8, 9), (5, 6), 2)),
])
def test_other_spellings_of_hot_messages_decode_the_same(text: str, message) -> None:
    assert decode(text.encode()) == message
