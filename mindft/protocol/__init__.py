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

from mindft.protocol.codec import (MESSAGE_TYPES, decode, encode, encode_heartbeat, encode_step_report)
from mindft.protocol.messages import (Ack, AckBatch, Action, ActionKind, AdoptNode, AgentHello, Cadence, CostReport,
                                      DeviceEvent, DeviceStatus, Done, FaultKind, FaultReport, Heartbeat,
                                      InjectRequest, JobState, JobView, MAX_FRAME, Message, NodeLost, OrderKind,
                                      Pace, ProcessExit, Progress, PROTOCOL_VERSION, ProtocolError, RankOrder,
                                      RankState, RankStatus, Register, RegisterAck, relay_cut, RELAY_SEPARATOR,
                                      Replaced, ReplicaReport, Reply, REPORT_SUFFIX, StatusReply, StatusRequest,
                                      StepBatch, StepReport, Superseded, WorldResize)

__all__ = ['Ack', 'AckBatch', 'Action', 'ActionKind', 'AdoptNode', 'AgentHello', 'Cadence', 'CostReport', 'decode',
           'DeviceEvent', 'DeviceStatus', 'Done', 'encode', 'encode_heartbeat', 'encode_step_report', 'FaultKind',
           'FaultReport', 'Heartbeat', 'InjectRequest', 'JobState', 'JobView', 'MAX_FRAME', 'Message',
           'MESSAGE_TYPES', 'NodeLost', 'OrderKind', 'Pace', 'ProcessExit', 'Progress', 'PROTOCOL_VERSION',
           'ProtocolError', 'RankOrder', 'RankState', 'RankStatus', 'Register', 'RegisterAck', 'relay_cut',
           'RELAY_SEPARATOR', 'Replaced', 'ReplicaReport', 'Reply', 'REPORT_SUFFIX', 'StatusReply', 'StatusRequest',
           'StepBatch', 'StepReport', 'Superseded', 'WorldResize']
