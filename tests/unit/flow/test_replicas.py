"""Replicas in the flow: lost protection as the node's sender judges it (:class:`Protection`) and
as the controller judges it from the node agents' reports (:class:`ReplicaWatch`), and the
rollback step after a node (and its agent's memory) is lost: one the lost ranks' replicas hold
and every other rank holds too, or the dying-gasp rung at once. The rules first, as tables; then
the same rules through the Job."""
from __future__ import annotations

import logging

import pytest

from mindft.exitcodes import ExitCode
from mindft.flow import JobState, KillRank, ProcessExited, StartRank
from mindft.flow.replicas import (ACK_MIN_RATE, KeptSteps, Protection, ReplicaWatch, ReportHold, ProtectionChange,
                                  no_common_step, rank_list, replicas_share_a_step)
from mindft.protocol import (Ack, ActionKind, FaultKind, FaultReport, JobView, NodeLost, Register, ReplicaReport,
                             Reply, StepReport)
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


# ---- the node's verdict (the sender's), with made-up times -----------------------------------

LOST, RESTORED = ProtectionChange.LOST, ProtectionChange.RESTORED


@pytest.mark.parametrize("events", [
    pytest.param([("judge", 100.0, None)], id="nothing captured: nothing behind"),
    pytest.param([("capture", 0.0), ("judge", 5.0, None), ("judge", 5.01, LOST), ("judge", 9.0, None)],
                 id="behind longer than lost_after: lost once"),
    pytest.param([("capture", 0.0), ("bytes", int(ACK_MIN_RATE)), ("judge", 5.9, None), ("judge", 6.01, LOST)],
                 id="a large push has its bytes at ACK_MIN_RATE more"),
    pytest.param([*[("capture", 0.0)] * 20, ("judge", 0.0, None), ("capture", 0.0), ("judge", 0.0, LOST)],
                 id="more than LOST_AFTER_CAPTURES captures behind"),
    pytest.param([("capture", 0.0), ("judge", 6.0, LOST), ("confirm", 1), ("judge", 6.0, RESTORED),
                  ("judge", 7.0, None)], id="the newest confirmed: restored once"),
    pytest.param([("capture", 0.0), ("capture", 3.0), ("confirm", 1), ("judge", 8.0, None), ("judge", 8.01, LOST)],
                 id="an older capture confirmed: behind since the next one"),
    pytest.param([("capture", 0.0), ("capture", 3.0), ("judge", 6.0, LOST), ("confirm", 1), ("judge", 6.0, RESTORED)],
                 id="an older capture confirmed restores while the next is young"),
])
def test_the_sender_judges_protection_from_captures_confirmations_and_time(events) -> None:
    protection = Protection(lost_after=5.0, lost_after_captures=20)
    lost = False
    for event in events:
        if event[0] == "capture":
            protection.capture(event[1])
        elif event[0] == "confirm":
            protection.confirmed(event[1])
        elif event[0] == "bytes":
            protection.nbytes = event[1]
        else:
            _, now, expected = event
            assert protection.judge(now) is expected, event
            lost = {LOST: True, RESTORED: False}.get(expected, lost)  # a verdict only when it changes
            assert protection.lost is lost, event


def test_captures_are_numbered_and_behind_counts_them() -> None:
    protection = Protection()
    assert [protection.capture(t) for t in (1.0, 2.0, 3.0)] == [1, 2, 3]
    protection.confirmed(2)
    assert protection.behind(10.0) == (1, 7.0)
    protection.confirmed(3)
    assert protection.behind(10.0) == (0, 0.0)


# ---- a rank's step reports wait for its replica ------------------------------------------------

@pytest.mark.parametrize("events, position, lost, reportable, unconfirmed", [
    pytest.param([], 9, False, 9, (), id="nothing captured: nothing held"),
    pytest.param([("capture", 3, 5)], 9, False, 4, (5,), id="not past a capture whose replica has not arrived"),
    pytest.param([("capture", 3, 5)], 3, False, 3, (5,), id="never more than the position"),
    pytest.param([("capture", 3, 5)], 9, True, 9, (5,), id="lost protection: the reports go on without it"),
    pytest.param([("capture", 3, 5), ("capture", 4, 6), ("confirm", 3, 0)], 9, False, 5, (6,),
                 id="a confirmed capture releases up to the next"),
    pytest.param([("capture", 3, 5), ("capture", 4, 6), ("confirm", 4, 0)], 9, False, 9, (),
                 id="a newer capture confirmed releases the older ones"),
    pytest.param([("capture", 3, 5), ("restore", 4), ("confirm", 3, 0)], 9, False, 3, (4,),
                 id="a push of the timeline before a restore proves nothing"),
    pytest.param([("capture", 3, 5), ("restore", 4), ("confirm", 5, 1)], 9, False, 9, (),
                 id="the first push of the new epoch clears the restored step"),
])
def test_step_reports_wait_for_the_replica_of_the_captures_they_pass(events, position: int, lost: bool,
                                                                      reportable: int, unconfirmed) -> None:
    hold = ReportHold()
    for event in events:
        if event[0] == "capture":
            hold.captured(event[1], event[2])
        elif event[0] == "confirm":
            hold.confirmed(event[1], event[2])
        else:
            assert hold.restored(event[1]) == hold.epoch == 1
    assert hold.reportable(position, lost) == reportable and hold.unconfirmed == unconfirmed


# ---- the controller's verdict, from the agents' reports ----------------------------------------

KEPT = KeptSteps(oldest=7, newest=8, finished=8)


@pytest.mark.parametrize("kept, step, agent_lost, was, unprotected, logged", [
    (KeptSteps(5, 6, 6), 5, False, False, False, None),  # one snapshot behind: within the buffers
    (KEPT, 6, False, False, True, "LOST PROTECTION"),    # older than both kept steps
    (KEPT, 6, False, True, True, None),                  # already lost: logged once
    (KEPT, 7, False, True, True, None),                  # back within the buffers, not caught up: no flapping
    (KEPT, 8, False, True, False, "protection restored"),
    (KEPT, -1, False, False, False, None),               # no replica yet: the agent's own judgment
    (KEPT, -1, True, False, True, "LOST PROTECTION"),    # the agent says it fell behind
    (KEPT, 8, True, False, True, "LOST PROTECTION"),     # ... whatever the step
    (None, 1, False, False, False, None),                # a recovery: only the agent's verdict counts
    (None, 1, False, True, True, None),
    (None, 9, False, True, True, None),                  # not restored during a recovery either
    (None, 1, True, False, True, "LOST PROTECTION"),
])
def test_the_controller_judges_a_report_against_the_steps_every_rank_keeps(
        caplog, kept, step: int, agent_lost: bool, was: bool, unprotected: bool, logged) -> None:
    caplog.set_level(logging.WARNING, "mindft.flow.replicas")
    watch = ReplicaWatch(unprotected={0} if was else set())
    assert watch.report(ReplicaReport(0, (0,), (step,), (0,) if agent_lost else ()), 2, kept) == ""
    assert (0 in watch.unprotected) == unprotected and watch.reported[0] == (step, agent_lost)
    assert [r.getMessage().split(":")[0].split(" ", 1)[1] for r in caplog.records] == ([logged] if logged else [])


def test_the_controller_keeps_what_the_agents_report_and_refuses_garbage() -> None:
    watch = ReplicaWatch()
    assert watch.report(ReplicaReport(node=0, ranks=(0, 1), steps=(5, 3), lost=(1,)), 2, KEPT) == ""
    assert watch.report(ReplicaReport(node=0, ranks=(0,), steps=(6,)), 2, KEPT) == ""
    assert watch.report(ReplicaReport(node=0, ranks=(0, 1), steps=(6,)), 2, KEPT) == "ranks and steps differ in length"
    assert watch.report(ReplicaReport(node=0, ranks=(2,), steps=(6,)), 2, KEPT) == "rank 2 is outside 0..1"
    assert watch.reported == {0: (6, False), 1: (3, True)} and watch.step(0) == 6 and watch.step(5) == -1


def test_replicas_kept_by_a_lost_node_are_gone_until_their_agent_pushes_a_new_one(caplog) -> None:
    caplog.set_level(logging.WARNING, "mindft.flow.replicas")
    watch, kept = ReplicaWatch(), KeptSteps(5, 6, 6)
    watch.report(ReplicaReport(0, (0, 1), (6, 6)), 4, kept)
    watch.node_lost(1, (0, 1), ended=False)
    assert watch.unprotected == {0, 1} and watch.step(0) == -1
    assert "rank=0 LOST PROTECTION: its replica (step 6) was on node 1, which was lost" in caplog.text
    watch.report(ReplicaReport(0, (0, 1), (6, 6)), 4, kept)  # its agent has not noticed: that replica is gone
    assert watch.reported == {0: (-1, False), 1: (-1, False)} and watch.unprotected == {0, 1}
    watch.report(ReplicaReport(0, (0, 1), (7, 7)), 4, KeptSteps(6, 7, 7))  # pushed to the new node
    assert watch.reported == {0: (7, False), 1: (7, False)} and watch.unprotected == set()
    watch.report(ReplicaReport(0, (0,), (6,)), 4, kept)  # the lost step is forgotten once a new one came
    assert watch.step(0) == 6


def test_a_lost_node_after_the_job_ended_marks_nothing_unprotected_and_recovery_clears_it() -> None:
    watch = ReplicaWatch()
    watch.node_lost(1, (0,), ended=True)
    assert watch.unprotected == set() and watch.reported == {0: (-1, False)}
    watch.node_lost(1, (0,), ended=False)
    watch.recovering(0)
    assert watch.unprotected == set()


# ---- a lost node: is a common step still possible? --------------------------------------------

@pytest.mark.parametrize("lost, known, possible", [
    ({}, None, True),                                   # nobody lost
    ({1: (4,)}, None, True),                            # nobody else counted yet
    ({1: (4,)}, frozenset({4, 5}), True),
    ({1: (4,)}, frozenset({6, 7}), False),              # the others no longer hold it
    ({1: ()}, None, False),                             # no replica at all
    ({1: (5,), 2: (4,)}, None, False),                  # the lost ranks' replicas share no step
    ({1: (6,), 2: (6,)}, frozenset({5, 6}), True),
    ({1: (6,), 2: (6,)}, frozenset(), False),
])
def test_a_common_rollback_step_is_possible_only_while_the_replicas_share_one(lost, known, possible: bool) -> None:
    assert replicas_share_a_step(lost, known) is possible


@pytest.mark.parametrize("lost, nodes, others, reason", [
    ({1: (4,)}, [1], [(0, (6, 7))],
     "node 1 lost: rank 1 only to step 4 (its replica) can roll back; rank 0 holds [6, 7]: no step"),
    ({2: ()}, [2], [], "node 2 lost: rank 2 only to nothing (no replica) can roll back: no step"),
    ({2: (5,), 3: (4,)}, [1, 1], [],
     "node 1 lost: rank 2 only to step 5 (its replica), rank 3 only to step 4 (its replica) can roll back: no step"),
    ({1: (3,), 3: (3,)}, [0, 1], [(0, (5, 6)), (2, (6, 5)), (4, (7,))],
     "nodes 0, 1 lost: rank 1 only to step 3 (its replica), rank 3 only to step 3 (its replica) can roll back; "
     "ranks 0, 2 hold [5, 6]; rank 4 holds [7]: no step"),
    ({r: (1,) for r in range(10)}, [0], [], "rank 7 only to step 1 (its replica), ... can roll back"),
])
def test_why_no_step_is_common_names_each_lost_rank_and_what_the_others_hold(lost, nodes, others, reason) -> None:
    text = no_common_step(lost, nodes, others)
    assert reason in text and text.endswith("so the job ends with dying-gasp checkpoints instead of a recovery "
                                            "that would lose the lost ranks' state")


@pytest.mark.parametrize("ranks, text", [([3], "rank 3"), ([0, 1, 2], "ranks 0, 1, 2"),
                                         (list(range(10)), "ranks 0, 1, 2, 3, 4, 5, 6, 7, ...")])
def test_rank_lists_in_log_lines(ranks: list[int], text: str) -> None:
    assert rank_list(ranks) == text


# ---- lost protection through the Job ----------------------------------------------------------------------------

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
    # The agents hear which ranks the job could not tell to dump: rank 1's replica is written by its keeper.
    assert d.job.view() == JobView(S.FAILED, False, 7, d.job.result.reason, (), -1, unreached=(1,))


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
    assert not any(isinstance(e, StartRank) for e in d.effects) and d.job.ladder.dump_step == 5
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
    assert "rank 1 (node 1 was lost; its new process has not registered)" in d.job.result.reason
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


def test_a_controller_started_again_names_the_ranks_that_never_registered_with_it_unreached() -> None:
    # Node 0 came back with a new controller: rank 1 re-registers, its collective with the lost
    # rank 0 fails, the job fails; rank 0's state is only in its replica, which its keeper writes.
    d = Driver(2)
    d.send(1, Register(1, 0, 101, ()))
    d.send(1, FaultReport(1, 9, FaultKind.COMMUNICATION, "peer gone"))
    assert d.job.state is S.FAILED and d.job.view().unreached == (0,)
