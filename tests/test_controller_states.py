"""The controller's state machine: the transition table is the law."""
from __future__ import annotations

import itertools

import pytest

from mindft.controller import TRANSITIONS, ControllerState, IllegalTransition, StateMachine

S = ControllerState
LEGAL = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
ALL_PAIRS = list(itertools.product(ControllerState, ControllerState))


def test_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(ControllerState)


def test_the_designed_flow_is_legal() -> None:
    machine = StateMachine()
    for target in (S.NORMAL, S.PAUSING, S.REPAIRING, S.ROLLBACK, S.RESUMING, S.NORMAL, S.DONE):
        machine.transition(target)
    assert machine.state is S.DONE


@pytest.mark.parametrize("state", [S.PAUSING, S.REPAIRING, S.ROLLBACK, S.RESUMING])
def test_a_further_fault_during_recovery_returns_to_pausing(state: ControllerState) -> None:
    machine = StateMachine(state)
    machine.transition(S.PAUSING)
    assert machine.state is S.PAUSING


@pytest.mark.parametrize("state", [s for s in ControllerState if s not in (S.FAILED, S.DONE)])
def test_every_live_state_can_fail(state: ControllerState) -> None:
    machine = StateMachine(state)
    machine.transition(S.FAILED)
    assert machine.state is S.FAILED


def test_terminal_states_have_no_exit() -> None:
    assert TRANSITIONS[S.FAILED] == frozenset()
    assert TRANSITIONS[S.DONE] == frozenset()


@pytest.mark.parametrize("source,target", [p for p in ALL_PAIRS if p not in LEGAL],
                         ids=lambda s: s.value)
def test_every_illegal_transition_raises(source: ControllerState, target: ControllerState) -> None:
    machine = StateMachine(source)
    assert not machine.can(target)
    with pytest.raises(IllegalTransition, match=f"{source.value} → {target.value}"):
        machine.transition(target)
    assert machine.state is source  # unchanged


@pytest.mark.parametrize("source,target", sorted(LEGAL), ids=lambda s: s.value)
def test_every_legal_transition_succeeds(source: ControllerState, target: ControllerState) -> None:
    machine = StateMachine(source)
    machine.transition(target)
    assert machine.state is target


def test_exact_table() -> None:
    # The design's flow, spelled out: a change here is a protocol change.
    assert LEGAL == {
        (S.STARTING, S.NORMAL), (S.STARTING, S.FAILED),
        (S.NORMAL, S.PAUSING), (S.NORMAL, S.FAILED), (S.NORMAL, S.DONE),
        (S.PAUSING, S.REPAIRING), (S.PAUSING, S.PAUSING), (S.PAUSING, S.FAILED),
        (S.REPAIRING, S.ROLLBACK), (S.REPAIRING, S.PAUSING), (S.REPAIRING, S.FAILED),
        (S.ROLLBACK, S.RESUMING), (S.ROLLBACK, S.PAUSING), (S.ROLLBACK, S.FAILED),
        (S.RESUMING, S.NORMAL), (S.RESUMING, S.PAUSING), (S.RESUMING, S.FAILED),
    }
