"""What the flow asks its shell to do (its inputs besides wire messages are in :mod:`mindft.flow.inputs`).

The core never performs I/O: every decision comes back as a list of these values, each with
the reason as data, and the shell (``mindft.controller``) carries them out in order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from mindft.exitcodes import ExitCode
from mindft.flow.states import JobState
from mindft.protocol import Message

Peer = bytes  # the shell's opaque address of a rank (a ZeroMQ identity)


@dataclass(frozen=True)
class Send:
    """Send ``message`` to one peer."""

    peer: Peer
    message: Message


@dataclass(frozen=True)
class Broadcast:
    """Send ``message`` to every peer in ``peers`` (the live ranks when it was decided)."""

    peers: tuple[Peer, ...]
    message: Message


@dataclass(frozen=True)
class KillRank:
    """Kill the process of ``rank`` (``pid``): it hung, or did not leave its device in time.

    ``restart``: start it again at once (a hang); otherwise wait for :class:`StartRank`.
    """

    rank: int
    pid: int
    reason: str
    restart: bool = True


@dataclass(frozen=True)
class StartRank:
    """Start ``rank``'s process again (it left its device for a hot reset, which is over)."""

    rank: int
    reason: str


@dataclass(frozen=True)
class Transition:
    """The job moved from ``source`` to ``target`` (for logs and timelines)."""

    source: JobState
    target: JobState
    reason: str


@dataclass(frozen=True)
class Finish:
    """The job is over: the controller exits with ``exit_code``."""

    exit_code: ExitCode
    reason: str


Effect = Union[Send, Broadcast, KillRank, StartRank, Transition, Finish]
