"""The transition table is the law: every move the flow makes is in it, and nothing else is."""
from __future__ import annotations

import pytest

from mindft.flow import RECOVERY_STATES, TERMINAL_STATES, TRANSITIONS, Event, IllegalTransition, JobState, next_state

S, E = JobState, Event


def test_the_designed_flow_is_in_the_table() -> None:
    state = S.STARTING
    for event in (E.ALL_REGISTERED, E.FAULT, E.ALL_PAUSED, E.REPAIRED, E.ALL_RESTORED, E.ALL_RESUMED, E.ALL_DONE):
        state = next_state(state, event)
    assert state is S.DONE


@pytest.mark.parametrize("state", sorted(RECOVERY_STATES))
def test_a_further_fault_during_recovery_starts_a_new_round(state: JobState) -> None:
    assert next_state(state, E.FAULT) is S.PAUSING


@pytest.mark.parametrize("state", [s for s in JobState if s not in TERMINAL_STATES])
def test_every_live_state_fails_on_timeout_and_on_an_unrecoverable_fault(state: JobState) -> None:
    assert next_state(state, E.TIMEOUT) is S.FAILED
    assert next_state(state, E.UNRECOVERABLE) is S.FAILED


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES))
@pytest.mark.parametrize("event", list(Event))
def test_terminal_states_have_no_exit(state: JobState, event: Event) -> None:
    with pytest.raises(IllegalTransition, match="none \\(terminal\\)"):
        next_state(state, event)


def test_a_fault_before_every_rank_registered_fails_the_job() -> None:
    assert next_state(S.STARTING, E.FAULT) is S.FAILED


def test_illegal_events_name_the_legal_ones() -> None:
    with pytest.raises(IllegalTransition, match="events allowed in NORMAL: all_done, fault, timeout, unrecoverable"):
        next_state(S.NORMAL, E.ALL_RESTORED)


def test_training_can_only_end_from_normal() -> None:
    assert {s for (s, e), t in TRANSITIONS.items() if t is S.DONE} == {S.NORMAL}
