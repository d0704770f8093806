"""Replicas in the flow: lost protection judged from the node agents' reports, and the rollback
step after a node (and its agent's memory) is lost: one the lost ranks' replicas hold and every
other rank holds too, or the dying-gasp rung at once."""
from __future__ import annotations

import logging

import pytest

from mindft.exitcodes import ExitCode
from mindft.flow import JobState, KillRank, ProcessExited, StartRank
from mindft.protocol import (Ack, ActionKind, FaultKind, FaultReport, NodeLost, Register, ReplicaReport, Reply,
                             StepReport)
from test_job import T, Driver

S = JobState
AGENT = b"agent-node"


def report(d: Driver, node: int, steps: dict[int, int], lost: tuple[int, ...] = ()) -> Reply:
    out = d.send(9, ReplicaReport(node, tuple(steps), tuple(steps.values()), lost))
    return out[-1].message


def lose(d: Driver, node: int, steps: dict[int, int], replicas_of: tuple[int, ...] = ()) -> Reply:
    out = d.job.handle(AGENT, NodeLost(node, tuple(steps), tuple(steps.values()), replicas_of, "test"), d.now)
    d.effects += out
    return [e.message for e in out if getattr(e, "peer", None) == AGENT][-1]


def protection(d: Driver) -> dict[int, tuple[int, bool]]:
    return {r.rank: (r.replicated, r.replica_lost) for r in d.job.status(d.now).ranks}


# ---- lost protection ----------------------------------------------------------------------------

def test_a_replica_older_than_both_kept_steps_is_lost_protection_logged_once_and_restored(caplog) -> None:
    caplog.set_level(logging.WARNING, "mindft.flow.job")
    d = Driver(2).start()
    d.steps(6)  # every rank keeps steps 5 and 6
    assert report(d, 0, {0: 5, 1: 6}).ok
    assert protection(d) == {0: (5, False), 1: (6, False)}  # one snapshot behind: within the buffers
    d.steps(8)
    report(d, 0, {0: 6, 1: 8})
    report(d, 0, {0: 6, 1: 8})
    assert protection(d) == {0: (6, True), 1: (8, False)}
    lost = [r.getMessage() for r in caplog.records if "LOST PROTECTION" in r.getMessage()]
    assert lost == ["rank=0 LOST PROTECTION: its newest replica (step 6) is older than both steps every rank "
                    "keeps (7 and 8); were its node lost now, the job could only end with dying-gasp checkpoints"]
    report(d, 0, {0: 7, 1: 8})  # back within the buffers, not caught up: still lost (no flapping)
    assert protection(d)[0] == (7, True)
    report(d, 0, {0: 8, 1: 8})
    assert protection(d)[0] == (8, False)
    assert sum("protection restored" in r.getMessage() for r in caplog.records) == 1


def test_the_agents_own_verdict_is_lost_protection_and_no_replica_yet_is_not() -> None:
    d = Driver(2).start()
    d.steps(5)
    report(d, 0, {0: -1, 1: -1})
    assert protection(d) == {0: (-1, False), 1: (-1, False)}  # the agent judges its first push
    report(d, 0, {0: 5, 1: -1}, lost=(1,))
    assert protection(d) == {0: (5, False), 1: (-1, True)}


def test_during_a_recovery_only_the_agents_verdict_counts() -> None:
    d = Driver(2).start()
    d.steps(6)
    d.send(0, FaultReport(0, 7, FaultKind.UCE))
    report(d, 0, {0: 1, 1: 6})  # the steps are being rolled back: no judgment from the window
    assert protection(d) == {0: (1, False), 1: (6, False)}
    report(d, 0, {0: 1, 1: 6}, lost=(0,))
    assert protection(d)[0] == (1, True)


def test_the_window_follows_the_cadence() -> None:
    d = Driver(2, every=3).start()
    d.steps(7)  # capture steps 3 and 6 kept
    report(d, 0, {0: 3, 1: 6})
    assert protection(d) == {0: (3, False), 1: (6, False)}
    report(d, 0, {0: 0, 1: 6})
    assert protection(d)[0] == (0, True)


@pytest.mark.parametrize("message, detail", [
    (ReplicaReport(0, (0, 1), (3,)), "ranks and steps differ in length"),
    (ReplicaReport(0, (0, 7), (3, 3)), "rank 7 is outside 0..1"),
    (NodeLost(1, (1,), (3, 4)), "ranks and steps must be non-empty and of the same length"),
    (NodeLost(1, (), ()), "ranks and steps must be non-empty and of the same length"),
    (NodeLost(1, (5,), (3,)), "rank 5 is outside 0..1"),
])
def test_bad_reports_are_refused_naming_what_is_wrong(message, detail: str) -> None:
    d = Driver(2).start()
    out = d.send(9, message)
    assert out[-1].message == Reply(False, detail, 0) and d.job.state is S.NORMAL


# ---- a lost node ------------------------------------------------------------------------------

def test_a_lost_node_rolls_back_to_the_step_its_replica_holds() -> None:
    d = Driver(4).start()
    d.steps(6)
    report(d, 1, {2: 6, 3: 6})
    answer = lose(d, 1, {2: 6, 3: 6}, replicas_of=(0, 1))
    assert answer.ok and "roll back to a step their replicas hold" in answer.detail
    assert d.job.state is S.PAUSING and [r.state for r in d.job.status(d.now).ranks] == \
        ["running", "running", "lost", "lost"]
    assert "rank 2 NODE LOST (node 1) in step 7" in d.job.status(d.now).reason
    d.ack_all(ActionKind.PAUSE, 7, held=(6, 7), ranks=(0, 1))
    assert d.job.state is S.REPAIRING  # feasible: waits for the new node's processes
    for rank in (2, 3):
        d.send(rank, Register(rank, 1, 300 + rank, (6,)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 6


def test_a_lost_node_whose_replica_the_others_no_longer_hold_fails_at_once() -> None:
    d = Driver(2).start()
    d.steps(6)
    lose(d, 1, {1: 4})
    d.send(0, Ack(0, ActionKind.PAUSE, 7, (6, 7), d.job.recovery.round))
    # Decided as soon as rank 0's steps are known: not when (or if) a new node starts rank 1.
    assert d.job.state is S.FAILED and d.job.result.exit_code == ExitCode.FAILED
    reason = d.job.result.reason
    assert ("node 1 lost: rank 1 only to step 4 (its replica) can roll back; rank 0 holds [6, 7]: no step "
            "every rank can restore, so the job ends with dying-gasp checkpoints") in reason
    dump = d.actions(ActionKind.DUMP_AND_EXIT)[-1]
    assert dump.step == 7 and "every rank dumps step 7" in reason  # the newest step the survivors share


def test_a_lost_node_without_any_replica_fails_before_anything_is_paused() -> None:
    d = Driver(3).start()
    d.steps(2)
    answer = lose(d, 2, {2: -1})
    assert d.job.state is S.FAILED and "rank 2 only to nothing (no replica) can roll back" in d.job.result.reason
    assert answer.detail.startswith("the job failed: node 2 lost") and not d.actions(ActionKind.PAUSE)
    assert d.actions(ActionKind.DUMP_AND_EXIT)[-1].step == 2


def test_lost_ranks_whose_replicas_share_no_step_fail_before_any_worker_restarts() -> None:
    # Workers that restart together may be blocked in a collective with the lost ranks: they are
    # stopped (their agents write the dying-gasp checkpoints from memory), and none is started.
    d = Driver(world=4)
    for rank in range(4):
        d.send(rank, Register(rank, 0, 100 + rank, (0,), collectives=True))
    d.steps(5)
    lose(d, 1, {2: 5, 3: 4})
    assert d.job.state is S.FAILED and sorted(e.rank for e in d.effects if isinstance(e, KillRank)) == [0, 1]
    assert not any(isinstance(e, StartRank) for e in d.effects) and d.job.dump_step == 5
    assert "rank 2 only to step 5 (its replica), rank 3 only to step 4 (its replica) can roll back: no step" \
        in d.job.result.reason


def test_a_node_reported_lost_after_its_ranks_were_found_hung_needs_no_new_round() -> None:
    d = Driver(2).start()
    d.steps(3)
    d.at(2.0)
    d.send(0, StepReport(0, 4))
    d.at(4.5)  # rank 1 silent for 4.5 s: hung, killed (nobody answers: its node is gone)
    assert d.job.state is S.PAUSING
    d.send(0, Ack(0, ActionKind.PAUSE, 4, (3, 4), 1))
    assert d.job.state is S.REPAIRING
    assert lose(d, 1, {1: 3}).ok
    assert d.job.recovery.round == 1 and d.job.state is S.REPAIRING
    assert "rank 1 NODE LOST (node 1) in step 4" in d.job.status(d.now).reason
    d.send(1, Register(1, 1, 301, (3,)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 3


def test_the_new_process_registers_what_it_really_holds() -> None:
    d = Driver(2).start()
    d.steps(4)
    lose(d, 1, {1: 4})
    d.send(0, Ack(0, ActionKind.PAUSE, 4, (3, 4), 1))
    # The agent restored step 4, but the process found nothing usable: its registration decides.
    d.send(1, Register(1, 1, 301, ()), incarnation=1)
    assert d.job.state is S.FAILED and "rank 1 holds []" in d.job.result.reason


def test_replicas_kept_by_the_lost_node_are_lost_protection_until_a_new_push() -> None:
    d = Driver(4).start()
    d.steps(6)
    report(d, 0, {0: 6, 1: 6})
    lose(d, 1, {2: 6, 3: 6}, replicas_of=(0, 1))
    assert protection(d)[0] == (-1, True) and protection(d)[1] == (-1, True)
    d.ack_all(ActionKind.PAUSE, 6, held=(5, 6), ranks=(0, 1))
    for rank in (2, 3):
        d.send(rank, Register(rank, 1, 300 + rank, (6,)), incarnation=1)
    for kind in (ActionKind.ROLLBACK, ActionKind.RESUME):
        for rank in range(4):
            d.send(rank, Ack(rank, kind, 6, (6,), d.job.recovery.round), incarnation=int(rank >= 2))
    assert d.job.state is S.NORMAL
    report(d, 0, {0: 6, 1: 6})  # node 0's agent has not noticed: the replica it names is gone
    assert protection(d)[0] == (-1, True)
    report(d, 0, {0: 6, 1: 6}, lost=(0,))
    assert protection(d)[0] == (-1, True)
    report(d, 0, {0: 7, 1: 7})  # pushed to the new node
    assert protection(d) == {0: (7, False), 1: (7, False), 2: (-1, False), 3: (-1, False)}


def test_a_lost_node_in_a_job_that_restarts_every_worker() -> None:
    d = Driver(world=2)
    for rank in range(2):
        d.send(rank, Register(rank, 0, 100 + rank, (0,), collectives=True))
    d.steps(3)
    lose(d, 1, {1: 3})
    assert [e.rank for e in d.effects if isinstance(e, KillRank)] == [0]  # rank 1 has no process left
    assert not any(isinstance(e, StartRank) for e in d.effects)
    d.effects += d.job.process_exit(ProcessExited(0, -9, 100), d.now)
    assert sorted(e.rank for e in d.effects if isinstance(e, StartRank)) == [0, 1]
    assert {row.order for row in d.job.status(d.now).ranks} == {"start"}  # the new node starts rank 1
    for rank in range(2):
        d.send(rank, Register(rank, 1, 200 + rank, (2, 3) if rank == 0 else (3,)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 3


def test_a_late_exit_report_of_a_lost_rank_changes_nothing() -> None:
    d = Driver(2).start()
    d.steps(2)
    lose(d, 1, {1: 2})
    out = d.job.process_exit(ProcessExited(1, -9, 101), d.now)
    assert out == [] and d.job.ranks.get(1).state.value == "lost"


def test_a_node_lost_before_the_job_started_or_after_it_ended_changes_nothing() -> None:
    d = Driver(2)
    d.send(0, Register(0, 0, 100))
    assert lose(d, 1, {1: -1}) == Reply(True, "the job has not started: nothing to recover", 0)
    assert d.job.state is S.STARTING
    d.send(1, Register(1, 0, 101))
    d.send(0, FaultReport(0, 1, FaultKind.UCE))
    d.send(0, Ack(0, ActionKind.PAUSE, 0, (0,), 1))
    d.send(1, Ack(1, ActionKind.PAUSE, 3, (2, 3), 1))
    assert d.job.state is S.FAILED
    assert lose(d, 1, {1: 3}).detail == "the job already ended (FAILED)"


def test_the_repair_timeout_names_the_lost_node() -> None:
    d = Driver(2).start()
    d.steps(2)
    lose(d, 1, {1: 2})
    d.send(0, Ack(0, ActionKind.PAUSE, 2, (1, 2), 1))
    while d.job.state is S.REPAIRING:
        d.send(0, StepReport(0, 2))
        d.at(d.now + 1.0)
    assert d.job.state is S.FAILED
    assert "rank 1 (not re-registered; node 1 was lost)" in d.job.result.reason
    assert d.now <= T.repair + 2
    assert d.actions(ActionKind.DUMP_AND_EXIT)[-1].step == 2  # the survivor dumps


def test_a_node_lost_while_every_worker_restarts_needs_no_new_round() -> None:
    d = Driver(world=2)
    for rank in range(2):
        d.send(rank, Register(rank, 0, 100 + rank, (0,), collectives=True))
    d.steps(3)
    d.job.process_exit(ProcessExited(0, -9, 100), d.now)  # rank 0 crashed: every worker restarts
    assert d.job.recovery.round == 1 and d.job.state is S.REPAIRING
    lose(d, 1, {1: 3})  # rank 1, stopped so every worker restarts, went with its node
    assert d.job.recovery.round == 1
    assert "rank 1 NODE LOST (node 1) in step 4" in d.job.status(d.now).reason
    d.effects += d.job.process_exit(ProcessExited(0, -9, 100), d.now)
    assert sorted(e.rank for e in d.effects if isinstance(e, StartRank)) == [0, 1]
    for rank in range(2):
        d.send(rank, Register(rank, 1, 200 + rank, (2, 3) if rank == 0 else (3,)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 3
