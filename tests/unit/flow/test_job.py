"""The job's own rules, driven message by message with a fake clock: no sockets, no threads.

Registration and the start barrier, step reports and heartbeats, the end, status and inject, the
snapshot cadence, the node agents; the recovery ladder the job holds is test_ladder.py's (its
:class:`Driver` is this module's)."""
from __future__ import annotations

import pytest

from mindft.config import Timeouts
from mindft.exitcodes import ExitCode
from mindft.flow import (Broadcast, DeviceFaulty, DeviceRecovered, Finish, Job, JobState, KillRank, ProcessExited,
                         RankState, Send, StartRank, StopJob, Transition, held_after)
from mindft.protocol import (Ack, Action, ActionKind, AgentHello, Done, FaultKind, FaultReport, Heartbeat, InjectRequest,
                             JobView, OrderKind, Progress, RankOrder, Register, RegisterAck, Reply, StatusReply,
                             StatusRequest, StepReport)

T = Timeouts(heartbeat_interval=1.0, heartbeat_misses=3, register=10.0, pause=5.0, repair=20.0, rollback=5.0,
             resume=5.0, leave=8.0)
S = JobState


def peer(rank: int, incarnation: int = 0) -> bytes:
    return f"rank{rank}.inc{incarnation}".encode()


class Driver:
    """A Job plus the effects it produced, with a clock the test moves."""

    def __init__(self, world: int = 3, every: int = 1) -> None:
        self.now = 0.0
        self.job = Job(world, T, self.now, snapshot_every=every)
        self.world = world
        self.effects: list = []

    def send(self, rank: int, message, incarnation: int = 0) -> list:
        out = self.job.handle(peer(rank, incarnation), message, self.now)
        self.effects += out
        return out

    def at(self, now: float) -> list:
        self.now = now
        out = self.job.tick(now)
        self.effects += out
        return out

    def start(self) -> Driver:
        for rank in range(self.world):
            self.send(rank, Register(rank, 0, 100 + rank, (0,)))
        return self

    def steps(self, upto: int, ranks=None) -> None:
        for step in range(1, upto + 1):
            for rank in ranks if ranks is not None else range(self.world):
                self.send(rank, StepReport(rank, step))

    def actions(self, kind: ActionKind) -> list[Action]:
        found = []
        for e in self.effects:
            if isinstance(e, (Send, Broadcast)) and isinstance(e.message, Action) and e.message.kind is kind:
                found.append(e.message)
        return found

    def ack_all(self, kind: ActionKind, step: int, held=None, ranks=None) -> None:
        round_ = self.job.recovery.round
        for rank in ranks if ranks is not None else range(self.world):
            self.send(rank, Ack(rank, kind, step, tuple(held if held is not None else (step - 1, step)), round_))


def test_start_barrier_then_normal() -> None:
    d = Driver(2)
    d.send(0, Register(0, 0, 10))
    assert d.job.state is S.STARTING and not any(isinstance(e, Broadcast) for e in d.effects)
    out = d.send(1, Register(1, 0, 11))
    assert d.job.state is S.NORMAL
    assert any(isinstance(e, Broadcast) and isinstance(e.message, RegisterAck) and len(e.peers) == 2 for e in out)


def test_start_barrier_times_out_naming_the_missing_ranks() -> None:
    d = Driver(3)
    d.send(1, Register(1, 0, 11))
    d.at(10.5)
    assert d.job.state is S.FAILED and "rank(s) [0, 2] (not registered)" in d.job.result.reason
    assert d.job.result.exit_code == ExitCode.FAILED


def test_progress_is_broadcast_only_when_the_slowest_rank_advances() -> None:
    d = Driver(2).start()
    assert d.send(0, StepReport(0, 1)) == []  # rank 1 is still at 0: nothing to tell
    out = d.send(1, StepReport(1, 1))
    assert [e.message for e in out] == [Progress(1)]


def test_no_heartbeat_is_broadcast_a_heartbeat_is_answered_to_its_sender_alone() -> None:
    d = Driver(3).start()
    d.steps(2)
    for t in (1.0, 2.0, 2.5):  # ticks send nothing: no broadcast per beat
        for rank in range(3):
            d.send(rank, StepReport(rank, 2))
        assert d.at(t) == []
    out = d.send(1, Heartbeat(1, 0, 2))
    assert out == [Send(peer(1), Heartbeat(-1, 0, 2))]  # the slowest rank's progress
    # A peer that is not a live registered incarnation hears nothing back: silence makes it re-register.
    assert d.send(1, Heartbeat(1, 0, 2), incarnation=7) == []
    assert d.send(5, Heartbeat(5, 0, 0)) == []


def test_step_reports_keep_a_rank_alive_without_heartbeats() -> None:
    d = Driver(2).start()
    for step in range(1, 10):  # 9 s of training; dead_after is 3 s
        d.at(float(step))
        d.send(0, StepReport(0, step))
        d.send(1, StepReport(1, step))
    assert d.job.state is S.NORMAL and not any(isinstance(e, KillRank) for e in d.effects)
    d.at(11.0)
    d.send(0, StepReport(0, 10))  # rank 0 goes on; rank 1 neither reports nor heartbeats: hung
    out = d.at(12.5)
    assert d.job.state is S.PAUSING and [e.rank for e in out if isinstance(e, KillRank)] == [1]


def test_a_dead_rank_and_an_ended_job_answer_no_heartbeat() -> None:
    d = Driver(2).start()
    d.job.process_exit(ProcessExited(1, -9, 101), d.now)
    assert d.send(1, Heartbeat(1, 0, 0)) == []  # the old incarnation is dead
    d.job.device(StopJob("test"), d.now)
    assert d.job.state is S.FAILED
    assert d.send(0, Heartbeat(0, 0, 0)) == []


def test_done_is_a_barrier_and_a_late_fault_rolls_finished_ranks_back_too() -> None:
    d = Driver(2).start()
    d.steps(5)
    d.send(0, Done(0, 5))
    assert d.job.state is S.NORMAL
    d.send(1, FaultReport(1, 5, FaultKind.UCE))
    d.ack_all(ActionKind.PAUSE, 4, held=(4, 5))
    d.ack_all(ActionKind.ROLLBACK, 5)
    d.ack_all(ActionKind.RESUME, 5, held=())
    assert d.job.state is S.NORMAL
    d.send(0, Done(0, 5))
    d.send(1, Done(1, 5))
    assert d.job.state is S.DONE and d.actions(ActionKind.FINISH)
    assert d.job.result == Finish(ExitCode.OK, "all 2 ranks finished at step 5; 1 recovery")


def test_done_counts_the_current_incarnation_only() -> None:
    # The job ends when its table counts every rank DONE (no scan per Done): a rank that
    # finished and was then restarted must finish again.
    d = Driver(2).start()
    d.steps(5)
    d.send(0, Done(0, 5))
    d.send(0, Register(0, 1, 200, (4, 5)), incarnation=1)  # its process died after Done; the launcher restarted it
    assert d.job.state is S.PAUSING and d.job.ranks.count(RankState.DONE) == 0
    round_ = d.job.recovery.round
    d.send(1, Ack(1, ActionKind.PAUSE, 5, (4, 5), round_))
    for kind in (ActionKind.ROLLBACK, ActionKind.RESUME):
        d.send(0, Ack(0, kind, 5, (4, 5), round_), incarnation=1)
        d.send(1, Ack(1, kind, 5, (4, 5), round_))
    assert d.job.state is S.NORMAL
    d.send(1, Done(1, 5))
    assert d.job.state is S.NORMAL and d.job.ranks.count(RankState.DONE) == 1
    d.send(0, Done(0, 5), incarnation=1)
    assert d.job.state is S.DONE


def test_inject_is_relayed_in_normal_and_refused_during_a_recovery() -> None:
    d = Driver(2).start()
    out = d.send(9, InjectRequest(0, FaultKind.UCE, "test", request_id=3))
    assert isinstance(out[0].message, Action) and out[0].peer == peer(0)
    assert out[1] == Send(peer(9), Reply(True, "rank 0 will raise UCE at its next step boundary; every rank then "
                                               "rolls back in place to the newest snapshot every rank holds (no "
                                               "process restarts)", 3))
    d.send(0, FaultReport(0, 1, FaultKind.UCE))
    refused = d.send(9, InjectRequest(1, FaultKind.UCE, request_id=4))[0].message
    assert not refused.ok and "PAUSING, not NORMAL" in refused.detail


def test_inject_says_every_worker_restarts_where_collectives_cannot_be_repaired_in_place() -> None:
    d = Driver(2)
    d.job = Job(2, T, 0.0)
    for rank in range(2):
        d.send(rank, Register(rank, 0, 100 + rank, (0,), collectives=True))
    detail = d.send(9, InjectRequest(1, FaultKind.UCE, "test", request_id=3))[1].message.detail
    assert detail.startswith("rank 1 will raise UCE at its next step boundary; its peers will block in their next "
                             "collective, which this job cannot repair in place")
    assert f"after {T.stall:g} s (MINDFT_STALL_TIMEOUT) every worker restarts from the node agents' memory" in detail
    assert "rolls back in place" not in detail


def test_status_counts_recoveries_and_answers_with_the_request_id() -> None:
    d = Driver(2).start()
    reply = d.send(7, StatusRequest(request_id=42))[0].message
    assert isinstance(reply, StatusReply) and reply.request_id == 42 and reply.recoveries == 0
    assert [r.state for r in reply.ranks] == ["running", "running"]


def test_messages_from_unknown_or_stale_peers_change_nothing() -> None:
    d = Driver(2).start()
    assert d.send(0, StepReport(0, 1), incarnation=5) == []
    assert d.send(1, FaultReport(1, 1, FaultKind.UCE), incarnation=3) == []
    assert d.job.state is S.NORMAL


def test_transitions_are_reported_with_their_reasons() -> None:
    d = Driver(2).start()
    d.send(1, FaultReport(1, 1, FaultKind.UCE, "x"))
    moves = [(e.source, e.target, e.reason) for e in d.effects if isinstance(e, Transition)]
    assert moves == [(S.STARTING, S.NORMAL, "all 2 ranks registered"),
                     (S.NORMAL, S.PAUSING, "rank 1 UCE in step 1 (x)")]


@pytest.mark.parametrize("progress, every, held", [(0, 1, {0}), (5, 1, {4, 5}), (7, 3, {3, 6}), (2, 3, {0})])
def test_held_after(progress: int, every: int, held: set[int]) -> None:
    assert held_after(progress, every) == held


def test_collectives_at_registration_make_a_lost_process_restart_every_worker() -> None:
    d = Driver(world=3)
    for rank in range(3):
        d.send(rank, Register(rank, 0, 100 + rank, (0,), collectives=True))
    d.steps(4)
    assert d.job.restart_all and d.job.status(d.now).restart_all
    d.effects.clear()
    d.job.process_exit(ProcessExited(1, -9, 101), d.now)
    out = d.job.process_exit(ProcessExited(1, -9, 101), d.now)  # reported twice: no second kill
    kills = [e for e in d.job.process_exit(ProcessExited(1, -9, 101), d.now) + out if isinstance(e, KillRank)]
    assert kills == []
    # Rank 1's process died: ranks 0 and 2 are killed, none started before every one exited.
    status = {row.rank: row.order for row in d.job.status(d.now).ranks}
    assert status == {0: "kill", 1: None, 2: "kill"}
    # Rank 2 still talks (a slow kill): its register is not taken for a restarted process.
    d.send(2, Register(2, 0, 102, (0, 4)))
    assert d.job.ranks.get(2).incarnation == 0 and d.job.state is S.REPAIRING
    for rank in (0, 2):
        d.effects += d.job.process_exit(ProcessExited(rank, -9, 100 + rank), d.now)
    starts = sorted(e.rank for e in d.effects if isinstance(e, StartRank))
    assert starts == [0, 1, 2]
    assert {row.order for row in d.job.status(d.now).ranks} == {"start"}
    for rank in range(3):
        d.send(rank, Register(rank, 1, 200 + rank, (3, 4)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 4


def test_without_collectives_a_lost_process_restarts_only_its_rank() -> None:
    d = Driver(world=3).start()
    d.steps(4)
    d.effects.clear()
    d.job.process_exit(ProcessExited(1, -9, 101), d.now)
    assert not d.job.restart_all
    assert [e for e in d.job.tick(d.now) if isinstance(e, KillRank)] == []
    assert all(row.order is None for row in d.job.status(d.now).ranks)


def test_the_budget_cadence_is_announced_past_every_decided_step_and_before_progress() -> None:
    from mindft.flow.cadence import Budget
    from mindft.protocol import Cadence, CostReport
    d = Driver(2)
    d.job = Job(2, T, d.now, budget=Budget(overhead=0.01, max_replay=50))
    d.start()
    d.steps(4)
    d.effects.clear()
    d.send(0, CostReport(0, 0.10, 0.010))  # every 10th step by rank 0's figures
    out = d.send(1, CostReport(1, 0.14, 0.025))  # the slowest figures: 18 (step 0.14, snapshot 0.025)
    cadences = [e.message for e in d.effects if isinstance(e, Broadcast) and isinstance(e.message, Cadence)]
    assert cadences == [Cadence((0, 1, 7, 10))]  # slowest 4: ranks may be deciding 6; 7 is free
    assert out == [] and d.job.tuner.schedule.segments == ((0, 1), (7, 10))
    # One change at a time: figures that ask for 18 wait until every rank reached step 7,
    # and the new cadence goes out before the Progress that lets ranks past its switch point.
    d.steps(6)
    assert not any(isinstance(e.message, Cadence) for e in d.effects[1:] if isinstance(e, Broadcast))
    d.effects.clear()
    d.steps(7)
    kinds = [type(e.message).__name__ for e in d.effects if isinstance(e, Broadcast)]
    assert kinds == ["Cadence", "Progress"], kinds
    assert d.job.tuner.schedule.segments == ((0, 1), (7, 10), (37, 18))
    assert d.job._register_ack().cadence == (0, 1, 7, 10, 37, 18)


def test_a_fixed_cadence_ignores_cost_reports() -> None:
    from mindft.protocol import CostReport
    d = Driver(2, every=4).start()
    d.steps(8)
    d.send(0, CostReport(0, 0.1, 0.5))
    assert d.job.tuner.schedule.segments == ((0, 4),)


def test_a_budget_the_replay_bound_cannot_meet_is_warned_once_until_it_is_met_again(caplog) -> None:
    import logging
    from mindft.flow.cadence import Budget
    from mindft.protocol import CostReport
    caplog.set_level(logging.INFO, "mindft.flow.cadence")
    d = Driver(2)
    d.job = Job(2, T, d.now, budget=Budget(overhead=0.01, max_replay=100))
    d.start()
    d.steps(2)

    def said(text: str) -> int:
        return sum(text in r.getMessage() for r in caplog.records)

    d.send(0, CostReport(0, 0.10, 0.010))  # every 10th step: within the budget
    assert said("over the 1% budget") == 0
    d.send(1, CostReport(1, 0.20, 0.40))  # 0.4 s every 100 steps of 0.2 s: 2%
    d.send(1, CostReport(1, 0.21, 0.40))
    warnings = [r for r in caplog.records if "over the 1% budget" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "2.0% of the step even every 100 steps" in warnings[0].getMessage()
    status = d.job.status(d.now)
    assert status.over_budget and status.overhead_budget == 0.01
    # every 10th step (rank 0's figures) is the cadence chosen last: 100 waits until it is reached
    assert (status.snapshot_every, status.snapshot_cost) == (10, 0.190476)  # 0.4 / (10 * 0.21)
    d.send(1, CostReport(1, 0.20, 0.10))  # 0.5%: met again
    assert said("fit the 1% budget again") == 1
    assert not d.job.status(d.now).over_budget
    d.send(1, CostReport(1, 0.20, 0.40))
    assert said("over the 1% budget") == 2


def test_the_budget_counts_the_cpu_of_the_node_agents_replication(caplog) -> None:
    import logging
    from mindft.flow.cadence import Budget
    from mindft.protocol import Cadence, CostReport, ReplicaReport
    caplog.set_level(logging.INFO, "mindft.flow.cadence")
    d = Driver(2)
    d.job = Job(2, T, d.now, budget=Budget(overhead=0.01, max_replay=100))
    d.start()
    d.steps(2)
    d.send(0, CostReport(0, 0.10, 0.010))  # every 10th step
    assert d.job.tuner.schedule.segments[-1][1] == 10
    d.send(9, ReplicaReport(-1, (0,), (0,), cpu_seconds=5.0))  # a rank's own replication is in its CostReport
    assert d.job.status(d.now).snapshot_cost == 0.01
    d.send(9, ReplicaReport(1, (0, 1), (0, 0), cpu_seconds=0.04))  # node 1's replication: 0.04 s of CPU per snapshot
    assert d.job.status(d.now).snapshot_cost == 0.05  # (0.01 + 0.04) / (10 * 0.10)
    d.effects.clear()
    d.steps(d.job.tuner.schedule.segments[-1][0] + 1)  # the change to 10 is reached: the next one may go out
    cadences = [e.message for e in d.effects if isinstance(e, Broadcast) and isinstance(e.message, Cadence)]
    assert cadences and d.job.tuner.schedule.segments[-1][1] == 50  # (0.01 + 0.04) / (0.01 * 0.10)
    assert "snapshot 0.0500 s of which 0.0400 s the busiest node's replication CPU" in caplog.text


def test_orders_go_to_the_agent_that_runs_the_rank_which_also_hears_every_transition() -> None:
    d = Driver(2)
    hello = d.job.handle(b"agent1", AgentHello(1, (1,)), d.now)
    assert hello == [Send(b"agent1", JobView(S.STARTING))]
    d.start()
    views = [e for e in d.effects if isinstance(e, Broadcast) and isinstance(e.message, JobView)]
    assert views and views[-1].peers == (b"agent1",) and views[-1].message.state is S.NORMAL
    d.at(3.5)  # rank 1 silent past dead_after: a hang
    kills = [e for e in d.effects if isinstance(e, KillRank)]
    assert {(k.rank, k.agent) for k in kills} >= {(1, b"agent1")}
    assert all(k.agent is None for k in kills if k.rank == 0)  # no agent said it runs rank 0
    assert kills[0].order() == RankOrder(kills[0].rank, OrderKind.KILL, kills[0].reason, kills[0].pid,
                                         kills[0].restart)


def test_an_agent_that_reconnects_is_told_the_orders_still_pending_for_its_ranks() -> None:
    d = Driver(2)
    d.job.handle(b"agent0", AgentHello(0, (0, 1)), d.now)
    d.start()
    d.steps(3)
    d.send(1, FaultReport(1, 4, FaultKind.UCE))
    d.job.device(DeviceFaulty(1, "0x1", "reset"), d.now)
    d.ack_all(ActionKind.PAUSE, 3)
    assert d.job.state is S.REPAIRING
    d.job.process_exit(ProcessExited(1, ExitCode.LEFT_DEVICE, 101), d.now)
    d.job.device(DeviceRecovered(1), d.now)
    again = d.job.handle(b"agent0.new", AgentHello(0, (0, 1)), d.now)
    assert again[0] == Send(b"agent0.new", JobView(S.REPAIRING))
    assert [(type(e), e.rank, e.agent) for e in again[1:]] == [(StartRank, 1, b"agent0.new")]


def test_the_status_says_who_a_recovery_waits_for_and_when_it_times_out() -> None:
    d = Driver(3).start()
    d.steps(2)
    d.job.device(DeviceFaulty(1, "0x1", "reset"), d.now)
    d.ack_all(ActionKind.PAUSE, 2)
    d.job.process_exit(ProcessExited(2, -9, 102), d.now)
    d.now = 4.0
    # A new round: the live ranks pause again, but rank 1, told to leave its chip, counts as gone.
    assert d.job.status(d.now).waiting == "rank 0"
    d.ack_all(ActionKind.PAUSE, 2, ranks=[0, 1])
    status = d.job.status(d.now)
    assert status.state is S.REPAIRING
    assert status.waiting == "rank 1 (its chip is being reset), rank 2 (its process is gone; a new one has not registered)"
    assert status.deadline_in == pytest.approx(T.repair)
    d.job.process_exit(ProcessExited(1, ExitCode.LEFT_DEVICE, 101), d.now)
    d.job.device(DeviceRecovered(1), d.now)
    assert d.job.status(d.now).waiting.startswith("rank 1 (its new process is starting: importing, joining")


def test_a_process_killed_so_every_worker_restarts_is_dead_not_off_its_device() -> None:
    d = Driver(world=2)
    for rank in range(2):
        d.send(rank, Register(rank, 0, 100 + rank, (0,), collectives=True))
    d.steps(4)
    d.job.process_exit(ProcessExited(1, -9, 101), d.now)  # rank 1 killed: rank 0 is stopped too
    d.job.process_exit(ProcessExited(0, -9, 100), d.now)
    assert [row.state for row in d.job.status(d.now).ranks] == ["dead", "dead"]


def test_a_stall_names_the_fault_that_caused_it_before_the_ranks_blocked_by_it() -> None:
    d = Driver(world=2)
    for rank in range(2):
        d.send(rank, Register(rank, 0, 100 + rank, (0,), collectives=True))
    d.steps(8)
    d.send(1, FaultReport(1, 9, FaultKind.UCE, "injected"))
    d.ack_all(ActionKind.PAUSE, 8, held=(7, 8), ranks=(1,))  # the faulted rank paused at its boundary
    d.now = T.stall - 0.5
    for rank in (0, 1):  # both alive; rank 0 never pauses: blocked in step 9's all-reduce with rank 1
        d.send(rank, Heartbeat(rank, 0, 8))
    d.at(T.stall + 0.1)
    reason = next(e.reason for e in d.effects if isinstance(e, Transition) and e.target is S.REPAIRING
                  or isinstance(e, Transition) and "restarting every worker" in e.reason)
    assert reason.startswith("rank 1 UCE in step 9 (injected); rank 0 did not pause within"), reason
