"""The job's states and the one table of transitions between them, keyed by (state, event)."""
from __future__ import annotations

import enum

from mindft.protocol import JobState


class IllegalTransition(RuntimeError):
    """An event arrived in a state the table has no transition for: the flow itself is broken."""


class Event(str, enum.Enum):
    """What moves the job from one state to the next."""

    ALL_REGISTERED = "all_registered"
    FAULT = "fault"                  # a new fault (or a new need of a known one): a new round
    ALL_PAUSED = "all_paused"
    REPAIRED = "repaired"            # every device back, every lost rank re-registered
    ALL_RESTORED = "all_restored"
    ALL_RESUMED = "all_resumed"
    ALL_DONE = "all_done"
    TIMEOUT = "timeout"              # a phase's deadline passed
    UNRECOVERABLE = "unrecoverable"  # a device failed, no common step, a stop was asked
    REJOIN = "rejoin"                # a controller started again found the job under way (flow/rejoin.py)


_S, _E = JobState, Event
RECOVERY_STATES = frozenset({_S.PAUSING, _S.REPAIRING, _S.ROLLBACK, _S.RESUMING})
TERMINAL_STATES = frozenset({_S.FAILED, _S.DONE})

TRANSITIONS: dict[tuple[JobState, Event], JobState] = {
    (_S.STARTING, _E.ALL_REGISTERED): _S.NORMAL,
    (_S.STARTING, _E.REJOIN): _S.PAUSING,
    (_S.NORMAL, _E.FAULT): _S.PAUSING,
    (_S.NORMAL, _E.ALL_DONE): _S.DONE,
    (_S.PAUSING, _E.ALL_PAUSED): _S.REPAIRING,
    (_S.REPAIRING, _E.REPAIRED): _S.ROLLBACK,
    (_S.ROLLBACK, _E.ALL_RESTORED): _S.RESUMING,
    (_S.RESUMING, _E.ALL_RESUMED): _S.NORMAL,
    **{(state, _E.FAULT): _S.PAUSING for state in RECOVERY_STATES},
    **{(state, event): _S.FAILED
       for state in (_S.STARTING, _S.NORMAL, *RECOVERY_STATES)
       for event in (_E.TIMEOUT, _E.UNRECOVERABLE, _E.FAULT if state is _S.STARTING else _E.TIMEOUT)},
}


def next_state(state: JobState, event: Event) -> JobState:
    """The state ``event`` leads to from ``state``; :class:`IllegalTransition` if the table has none."""
    target = TRANSITIONS.get((state, event))
    if target is None:
        allowed = ", ".join(sorted(e.value for (s, e) in TRANSITIONS if s is state)) or "none (terminal)"
        raise IllegalTransition(f"no transition from {state.value} on {event.value}; "
                                f"events allowed in {state.value}: {allowed}")
    return target
