"""The recovery ladder (mindft.flow.ladder, mindft.flow.lost), driven through the Job that holds it
message by message with a fake clock: a round to the newest common step, phase timeouts, hangs, hot
resets, deterministic failures, process exits, a lost scheduler, the dying gasp."""
from __future__ import annotations

import pytest

from mindft.exitcodes import ExitCode
from mindft.flow import (Broadcast, DeviceFailed, DeviceFaulty, DeviceRecovered, Finish, HoldRepairs, Job, JobState,
                         KillRank, ProcessExited, RollbackAll, Send, StartRank, StopJob, Transition)
from mindft.flow.inputs import SchedulerLost
from mindft.protocol import (Ack, Action, ActionKind, AgentHello, Done, FaultKind, FaultReport, Heartbeat, JobView,
                             Progress, ProcessExit, Register, Reply, StepReport)

from test_job import T, Driver, peer

S = JobState


def test_a_reported_fault_runs_one_round_to_the_newest_common_step() -> None:
    d = Driver(3).start()
    d.steps(4)
    d.send(2, StepReport(2, 5))
    d.send(1, FaultReport(1, 5, FaultKind.UCE, "boom"))
    assert d.job.state is S.PAUSING and d.actions(ActionKind.PAUSE)[0].round == 1
    d.send(0, Ack(0, ActionKind.PAUSE, 4, (3, 4), 1))
    d.send(1, Ack(1, ActionKind.PAUSE, 4, (3, 4), 1))
    d.send(2, Ack(2, ActionKind.PAUSE, 5, (4, 5), 1))
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 4
    d.ack_all(ActionKind.ROLLBACK, 4)
    assert d.job.state is S.RESUMING
    d.ack_all(ActionKind.RESUME, 4, held=())
    assert d.job.state is S.NORMAL and d.job.ranks.slowest == 4 and len(d.job.recoveries) == 1


def test_ranks_without_a_common_step_fail_the_job_naming_what_each_holds() -> None:
    d = Driver(2).start()
    d.send(0, FaultReport(0, 1, FaultKind.UCE))
    d.send(0, Ack(0, ActionKind.PAUSE, 0, (0,), 1))
    d.send(1, Ack(1, ActionKind.PAUSE, 3, (2, 3), 1))
    assert d.job.state is S.FAILED
    assert "rank 0 holds [0]; rank 1 holds [2, 3]" in d.job.result.reason


@pytest.mark.parametrize("phase, state", [("pause", S.PAUSING), ("rollback", S.ROLLBACK), ("resume", S.RESUMING)])
def test_every_phase_times_out_into_failed_naming_who_and_the_dump_step(phase: str, state: JobState) -> None:
    d = Driver(2).start()
    d.steps(3)
    d.send(1, FaultReport(1, 4, FaultKind.UCE))
    for kind in (ActionKind.PAUSE, ActionKind.ROLLBACK, ActionKind.RESUME):
        if d.job.state is state:
            break
        d.ack_all(kind, 3, held=() if kind is ActionKind.RESUME else (2, 3))
    assert d.job.state is state
    d.send(0, Ack(0, {"pause": ActionKind.PAUSE, "rollback": ActionKind.ROLLBACK,
                      "resume": ActionKind.RESUME}[phase], 3, (2, 3), d.job.recovery.round))
    deadline = d.now + getattr(T, phase)
    while d.job.state is state:  # both ranks stay alive (heartbeats); rank 1 just never answers
        for rank in range(2):
            d.send(rank, Heartbeat(rank, 0, 3))
        d.at(min(d.now + 1.0, deadline + 0.1))
    assert d.job.state is S.FAILED
    reason = d.job.result.reason
    assert f"{state.value} timed out after {getattr(T, phase):g} s (timeouts.{phase})" in reason
    assert "waiting for rank 1" in reason and "rank 1 UCE in step 4" in reason
    dump = d.actions(ActionKind.DUMP_AND_EXIT)[-1]
    assert dump.step == 3 and "every rank dumps step 3" in reason  # the step dumped, not the faulty one


def test_a_silent_rank_is_killed_and_paused_around_then_restarted() -> None:
    d = Driver(2).start()
    d.steps(2)
    d.at(2.0)
    d.send(0, Heartbeat(0, 0, 2))
    out = d.at(4.5)  # rank 1 silent since 0.0 > dead_after = 3 s
    kill = [e for e in out if isinstance(e, KillRank)]
    assert kill and kill[0].rank == 1 and kill[0].pid == 101
    assert d.job.state is S.PAUSING
    d.send(0, Ack(0, ActionKind.PAUSE, 2, (1, 2), 1))
    assert d.job.state is S.REPAIRING  # waits for the new incarnation
    d.send(1, Register(1, 1, 201, (1, 2)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 2
    assert d.job.status(d.now).ranks[1].restarts == 1


def test_the_hot_reset_contract_leave_the_device_then_come_back() -> None:
    d = Driver(2).start()
    d.steps(3)
    d.job.device(DeviceFaulty(1, "0x8C03A000", "reset"), d.now)
    d.ack_all(ActionKind.PAUSE, 3, held=(2, 3))
    assert d.job.state is S.REPAIRING
    leave = d.actions(ActionKind.LEAVE_DEVICE)
    assert len(leave) == 1 and "device reset" in leave[0].reason  # only the rank on the chip leaves
    # The device comes back only after the process left (the plugin resets a chip nobody uses).
    d.job.process_exit(ProcessExited(1, ExitCode.LEFT_DEVICE, 101), d.now)
    assert d.job.state is S.REPAIRING
    out = d.job.device(DeviceRecovered(1), d.now)
    assert [e.rank for e in out if isinstance(e, StartRank)] == [1]
    d.send(1, Register(1, 1, 201, (2, 3)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 3


def test_a_second_hot_reset_while_a_rank_leaves_its_chip_does_not_wait_for_it() -> None:
    # unrecovered for rank 1, then (0.2 s later) for ranks 1 and 2: rank 1 is on its way out.
    d = Driver(4).start()
    d.steps(3)
    d.job.device(DeviceFaulty(1), d.now)
    d.ack_all(ActionKind.PAUSE, 3, held=(2, 3))
    assert [a.kind for a in d.actions(ActionKind.LEAVE_DEVICE)] == [ActionKind.LEAVE_DEVICE]
    d.now += 0.2
    d.job.device(DeviceFaulty(1), d.now)
    d.job.device(DeviceFaulty(2), d.now)
    assert d.job.state is S.PAUSING and d.job.recovery.round == 2
    assert d.job.recovery.waiting == {0, 2, 3}  # a rank told to leave counts as gone
    d.ack_all(ActionKind.PAUSE, 3, held=(2, 3), ranks=(0, 2, 3))
    assert d.job.state is S.REPAIRING and len(d.actions(ActionKind.LEAVE_DEVICE)) == 2
    for rank in (1, 2):
        d.job.process_exit(ProcessExited(rank, ExitCode.LEFT_DEVICE, 100 + rank), d.now)
        out = d.job.device(DeviceRecovered(rank), d.now)
        assert [e.rank for e in out if isinstance(e, StartRank)] == [rank]
        d.send(rank, Register(rank, 1, 200 + rank, (2, 3)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 3


def test_a_chip_that_faults_while_the_job_repairs_is_left_at_once() -> None:
    d = Driver(2).start()
    d.send(0, FaultReport(0, 1, FaultKind.UCE, "x"))
    d.job.device(HoldRepairs(True), d.now)
    d.ack_all(ActionKind.PAUSE, 0, held=(0,))
    assert d.job.state is S.REPAIRING and not d.actions(ActionKind.LEAVE_DEVICE)
    out = d.job.device(DeviceFaulty(0), d.now)  # the rank already in this recovery: no new round
    leave = [e for e in out if isinstance(e, Send) and isinstance(e.message, Action)
             and e.message.kind is ActionKind.LEAVE_DEVICE]
    assert d.job.state is S.REPAIRING and [e.peer for e in leave] == [peer(0)]


def test_a_rank_that_dies_while_its_chip_is_reset_is_started_when_the_chip_is_back() -> None:
    d = Driver(2).start()
    out = d.job.device(DeviceFaulty(1), d.now)
    views = [e.message for e in out if isinstance(e, Broadcast) and isinstance(e.message, JobView)]
    d.send(9, AgentHello(0, (0, 1)))
    views += [e.message for e in d.effects if isinstance(e, Send) and isinstance(e.message, JobView)]
    assert views and all(v.resetting == (1,) for v in views)  # no agent restarts it on its own
    d.job.process_exit(ProcessExited(1, -9, 101), d.now)  # before it was told to leave
    d.ack_all(ActionKind.PAUSE, 0, held=(0,), ranks=(0,))
    assert d.job.state is S.REPAIRING
    out = d.job.device(DeviceRecovered(1), d.now)
    assert [e.rank for e in out if isinstance(e, StartRank)] == [1]


def test_a_rank_that_does_not_leave_its_device_is_killed_in_time_and_not_restarted_early() -> None:
    d = Driver(2).start()
    d.job.device(DeviceFaulty(0), d.now)
    d.ack_all(ActionKind.PAUSE, 0, held=(0,))
    kills = []
    for _ in range(30):
        for rank in (0, 1):
            d.send(rank, Heartbeat(rank, 0, 0))
        kills = [e for e in d.at(d.now + 1.0) if isinstance(e, KillRank)]
        if kills:
            break
    assert d.now <= T.leave + 1.0 < 60.0  # well inside the device plugin's 60 s
    assert kills[0].rank == 0 and not kills[0].restart and "timeouts.leave" in kills[0].reason
    d.job.process_exit(ProcessExited(0, -9, 100), d.now)
    assert not any(isinstance(e, StartRank) for e in d.effects)  # the device is not back yet


def test_a_failed_device_fails_the_job() -> None:
    d = Driver(2).start()
    d.job.device(DeviceFaulty(0), 0.0)
    out = d.job.device(DeviceFailed(0, "reset failed"), 0.0)
    assert d.job.state is S.FAILED and any(isinstance(e, Finish) for e in out)
    assert "could not be recovered (reset failed)" in d.job.result.reason


def test_fault_flushing_holds_the_repair_until_released() -> None:
    d = Driver(2).start()
    d.job.device(HoldRepairs(True), d.now)
    d.job.device(RollbackAll("clusterd restart-all"), d.now)
    d.ack_all(ActionKind.PAUSE, 0, held=(0,))
    assert d.job.state is S.REPAIRING
    d.job.device(HoldRepairs(False), d.now)
    assert d.job.state is S.ROLLBACK


def test_a_graceful_exit_stops_the_job_with_dumps() -> None:
    d = Driver(2).start()
    d.steps(3)
    out = d.job.device(StopJob("Volcano graceful exit"), d.now)
    dumps = [e.message for e in out if isinstance(e, Broadcast) and isinstance(e.message, Action)]
    assert dumps and dumps[0].kind is ActionKind.DUMP_AND_EXIT and dumps[0].step == 3


def _recover_in_place(d: Driver, step: int) -> None:
    d.ack_all(ActionKind.PAUSE, step)
    d.ack_all(ActionKind.ROLLBACK, step)
    d.ack_all(ActionKind.RESUME, step)
    assert d.job.state is S.NORMAL


def test_an_exception_from_the_training_script_ends_the_job_at_once_with_exit_1() -> None:
    d = Driver(2).start()
    d.steps(4)
    out = d.send(1, FaultReport(1, 5, FaultKind.USER_ERROR, "ValueError: bad batch"))
    assert d.job.state is S.FAILED and d.job.result.exit_code == ExitCode.FAILED
    assert "rank 1 raised an exception from the training script in step 5" in d.job.result.reason
    assert d.actions(ActionKind.DUMP_AND_EXIT)[-1].step == 4 and not d.actions(ActionKind.ROLLBACK)
    assert d.job.status(d.now).recoveries == 0 and d.job.view().exit_code == ExitCode.FAILED
    assert any(isinstance(e, Finish) for e in out)


@pytest.mark.parametrize("kind, first, again, final", [
    (FaultKind.UCE, 5, 5, True),                    # the same step again: deterministic
    (FaultKind.UCE, 5, 6, False),                   # another step: a new fault, recovered
    (FaultKind.COMMUNICATION, 5, 5, True),
    (FaultKind.UNKNOWN, 5, 4, False),
])
def test_the_same_fault_in_the_same_step_after_a_recovery_ends_the_job(kind, first, again, final) -> None:
    d = Driver(2).start()
    d.steps(first - 1)
    d.send(0, FaultReport(0, first, kind, "x"))
    _recover_in_place(d, first - 1)
    d.steps(again - 1)
    d.send(0, FaultReport(0, again, kind, "x"))
    assert (d.job.state is S.FAILED) is final
    if final:
        assert f"rank 0 {kind.name} in step {again} again after the job recovered from it" in d.job.result.reason
        assert d.job.view().exit_code == ExitCode.FAILED


@pytest.mark.parametrize("again, final", [(5, True), (6, True), (7, False)])
def test_a_process_lost_again_within_a_step_of_the_last_loss_ends_the_job(again: int, final: bool) -> None:
    # A lost process's step is the one after its last report that arrived: it may lag by one.
    d = Driver(2).start()
    d.steps(4)
    d.job.process_exit(ProcessExited(1, -9, 101), d.now)
    d.ack_all(ActionKind.PAUSE, 4, ranks=(0,))
    d.send(1, Register(1, 1, 201, (3, 4)), incarnation=1)
    for kind in (ActionKind.ROLLBACK, ActionKind.RESUME):
        for rank in (0, 1):
            d.send(rank, Ack(rank, kind, 4, (3, 4), d.job.recovery.round), incarnation=rank)
    assert d.job.state is S.NORMAL
    for step in range(5, again):
        for rank in (0, 1):
            d.send(rank, StepReport(rank, step, d.job.recovery.round), incarnation=rank)
    d.job.process_exit(ProcessExited(1, -9, 201), d.now)
    assert (d.job.state is S.FAILED) is final


def test_a_failed_job_whose_ranks_may_be_blocked_in_a_collective_stops_them_for_their_agents_to_dump() -> None:
    d = Driver(2)
    d.job = Job(2, T, 0.0, restart_scope="all")
    d.start()
    d.send(9, AgentHello(0, (0, 1)))
    d.steps(3)
    out = d.send(1, FaultReport(1, 4, FaultKind.USER_ERROR, "ValueError"))
    kills = [e for e in out if isinstance(e, KillRank)]
    assert [(k.rank, k.restart, k.agent) for k in kills] == [(0, False, peer(9)), (1, False, peer(9))]
    assert all(not e.peers for e in out if isinstance(e, Broadcast) and isinstance(e.message, Action))


def test_a_rank_that_cannot_rewind_fails_the_job_with_its_own_exit_code() -> None:
    d = Driver(2).start()
    d.job.process_exit(ProcessExited(1, ExitCode.REWIND_REQUIRED, 101), d.now, will_restart=False)
    assert d.job.state is S.FAILED and d.job.view().exit_code == ExitCode.REWIND_REQUIRED
    assert "Model.train cannot re-enter" in d.job.result.reason


def test_process_exits_stale_pid_ignored_current_pauses_final_fails() -> None:
    d = Driver(2).start()
    out = d.send(5, ProcessExit(1, -9, pid=999, request_id=7))
    assert out == [Send(peer(5), Reply(True, "pid 999 is not rank 1's current process", 7))]
    d.job.process_exit(ProcessExited(1, -9, 101), d.now)
    assert d.job.state is S.PAUSING and d.job.status(d.now).ranks[1].state == "dead"
    d.job.process_exit(ProcessExited(0, 3, 100), d.now, will_restart=False)
    assert d.job.state is S.FAILED and "will not be restarted" in d.job.result.reason


def test_an_exit_before_every_rank_registered_fails_at_once() -> None:
    d = Driver(2)
    d.send(0, Register(0, 0, 100))
    d.job.process_exit(ProcessExited(1, 1, 101), d.now)
    assert d.job.state is S.FAILED and "before every rank registered" in d.job.result.reason


def test_a_recovery_ends_with_progress_only_when_ranks_got_past_the_repair_step() -> None:
    def recover(report_during_resume: bool) -> list:
        d = Driver(2).start()
        d.steps(4)
        d.send(1, FaultReport(1, 5, FaultKind.UCE))
        d.ack_all(ActionKind.PAUSE, 4, held=(3, 4))
        d.ack_all(ActionKind.ROLLBACK, 4)
        round_ = d.job.recovery.round
        d.send(0, Ack(0, ActionKind.RESUME, 4, (), round_))
        if report_during_resume:  # resumed ranks train on while the last acknowledgement is on its way
            d.send(0, StepReport(0, 5, round_))
            d.send(1, StepReport(1, 5, round_))
        out = d.send(1, Ack(1, ActionKind.RESUME, 4, (), round_))
        assert d.job.state is S.NORMAL
        return [e.message for e in out if isinstance(e, Broadcast)]

    assert recover(report_during_resume=False) == []  # RESUME already told every rank step 4
    assert recover(report_during_resume=True) == [Progress(5)]


# ---- MindSpore's scheduler is a member of the job ----


def collective_job(world: int = 2, steps: int = 4) -> Driver:
    d = Driver(world)
    for rank in range(world):
        d.send(rank, Register(rank, 0, 100 + rank, (0,), collectives=True))
    d.steps(steps)
    d.effects.clear()
    return d


def test_a_lost_scheduler_restarts_every_worker_from_memory_and_names_the_fault() -> None:
    d = collective_job()
    out = d.job.scheduler_lost(SchedulerLost(77, -9, ""), d.now)
    assert d.job.state is S.REPAIRING and d.job.recovery.restart_all
    assert sorted((k.rank, k.pid, k.restart) for k in out if isinstance(k, KillRank)) == [(0, 100, False),
                                                                                          (1, 101, False)]
    reason = d.job.status(d.now).reason
    assert reason.startswith("SCHEDULER_LOST in step 5 (MindSpore's scheduler, pid 77, killed by SIGKILL)")
    assert any(isinstance(e, Transition) and "restarting every worker" in e.reason for e in out)
    for rank in range(2):
        d.effects += d.job.process_exit(ProcessExited(rank, -9, 100 + rank), d.now)
    assert sorted(e.rank for e in d.effects if isinstance(e, StartRank)) == [0, 1]
    for rank in range(2):
        d.send(rank, Register(rank, 1, 200 + rank, (3, 4), collectives=True), incarnation=1)
    for kind in (ActionKind.ROLLBACK, ActionKind.RESUME):
        for rank in range(2):
            d.send(rank, Ack(rank, kind, 4, (3, 4), d.job.recovery.round), incarnation=1)
    assert d.job.state is S.NORMAL and len(d.job.recoveries) == 1
    assert d.job.recovery.scheduler is None  # the next recovery starts without it


@pytest.mark.parametrize("state", ["pausing", "repairing"])
def test_a_scheduler_lost_during_another_recovery_restarts_every_worker_in_a_new_round(state: str) -> None:
    d = Driver(2).start()  # no collectives: a fault rolls back in place
    d.steps(4)
    d.send(1, FaultReport(1, 5, FaultKind.UCE))
    if state == "repairing":
        d.job.device(DeviceFaulty(1, "0x1", "reset"), d.now)
        d.ack_all(ActionKind.PAUSE, 4)
        d.job.process_exit(ProcessExited(1, ExitCode.LEFT_DEVICE, 101), d.now)  # off its chip for the reset
        assert d.job.state is S.REPAIRING
    round_ = d.job.recovery.round
    out = d.job.scheduler_lost(SchedulerLost(77, 1, "[ERROR] gone"), d.now)
    assert d.job.recovery.restart_all and d.job.recovery.round == round_ + 1
    assert "SCHEDULER_LOST" in d.job.status(d.now).reason and "rank 1 " in d.job.status(d.now).reason
    assert "its log: [ERROR] gone" in d.job.status(d.now).reason
    assert {k.rank for k in out if isinstance(k, KillRank)} == ({0} if state == "repairing" else {0, 1})
    d.effects = list(d.job.process_exit(ProcessExited(0, -9, 100), d.now))
    if state == "repairing":  # every worker starts again once rank 1's chip is back too
        assert not any(isinstance(e, StartRank) for e in d.effects)
        d.effects += d.job.device(DeviceRecovered(1), d.now)
    else:
        d.effects += d.job.process_exit(ProcessExited(1, -9, 101), d.now)
    assert sorted(e.rank for e in d.effects if isinstance(e, StartRank)) == [0, 1]


def test_a_scheduler_lost_while_the_new_workers_start_stops_them_too() -> None:
    d = collective_job()
    d.job.process_exit(ProcessExited(1, -9, 101), d.now)  # every worker restarts
    d.job.process_exit(ProcessExited(0, -9, 100), d.now)
    assert {row.order for row in d.job.status(d.now).ranks} == {"start"}
    d.send(0, Register(0, 1, 200, (3, 4), collectives=True), incarnation=1)  # rank 1's new process not yet
    out = d.job.scheduler_lost(SchedulerLost(78, -9, ""), d.now)
    # Both new processes joined the lost scheduler's cluster: the registered one by its pid, the other by any.
    assert sorted((k.rank, k.pid) for k in out if isinstance(k, KillRank)) == [(0, 200), (1, 0)]
    d.job.process_exit(ProcessExited(1, -9, 301), d.now)  # a pid the job never learnt: still rank 1's exit
    d.effects.clear()
    d.effects += d.job.process_exit(ProcessExited(0, -9, 200), d.now)
    assert sorted(e.rank for e in d.effects if isinstance(e, StartRank)) == [0, 1]


@pytest.mark.parametrize("when, detail", [
    ("starting", "before every rank registered"),
    ("out of restarts", "used all its restarts (--max-restarts)"),
])
def test_a_lost_scheduler_fails_the_job_with_dying_gasps(when: str, detail: str) -> None:
    if when == "starting":
        d = Driver(2)
        d.send(0, Register(0, 0, 100, (0,), collectives=True))
        d.effects += d.job.scheduler_lost(SchedulerLost(77, 1, ""), d.now)
    else:
        d = collective_job()
        d.effects += d.job.scheduler_lost(SchedulerLost(77, -9, "", will_restart=False), d.now)
    assert d.job.state is S.FAILED and detail in d.job.result.reason
    assert d.actions(ActionKind.DUMP_AND_EXIT)


def test_a_scheduler_lost_after_the_job_ended_changes_nothing() -> None:
    d = collective_job(steps=2)
    for rank in range(2):
        d.send(rank, Done(rank, 2))
    assert d.job.state is S.DONE
    assert d.job.scheduler_lost(SchedulerLost(77, -9, ""), d.now) == [] and d.job.state is S.DONE
