"""The node agent's rules (mindft.flow.agent), as tables: an exit or an order, the job's view,
and what the agent must do. No process is started."""
from __future__ import annotations

from typing import Optional

import pytest

from mindft.exitcodes import ExitCode
from mindft.flow.agent import (CONTROLLER_FINISH_TIMEOUT, DUMP_GRACE_PERIOD, AbortJob, Ending, KillWorker, NodePolicy,
                               Say, StartWorker, WorkerPhase, job_exit_code)
from mindft.flow.inputs import SchedulerLost
from mindft.flow.watcher import WatcherSupervision
from mindft.protocol import JobState, JobView, OrderKind, ProcessExit, RankOrder

S = JobState


def policy(view: Optional[JobView] = JobView(S.NORMAL), max_restarts: int = 2, **kwargs) -> NodePolicy:
    node = NodePolicy((0, 1), max_restarts, **kwargs)
    for rank in (0, 1):
        node.started(rank, 100 + rank)
    if view is not None:
        node.on_view(view)
    return node


def decisions(effects: list) -> list:
    """The effects without the lines for people."""
    return [e for e in effects if not isinstance(e, Say)]


@pytest.mark.parametrize("view, code, kwargs, expected, phase", [
    # a clean exit, or any exit once a signal stops the node: nothing to decide
    (JobView(S.NORMAL), 0, {}, [], WorkerPhase.FINAL),
    # a crash: restarted here at once, and reported so the job counts the fault
    (JobView(S.NORMAL), -9, {}, [ProcessExit(1, -9, 101, True), StartWorker(1, 1, "")], WorkerPhase.RUNNING),
    # a crash where a restarted process cannot rejoin the collectives: the job restarts every worker
    (JobView(S.NORMAL, restart_all=True), -9, {}, [ProcessExit(1, -9, 101, True)], WorkerPhase.AWAITING_START),
    # it left its device for a hot reset: back when the controller says (its device is back)
    (JobView(S.REPAIRING), ExitCode.LEFT_DEVICE, {}, [ProcessExit(1, ExitCode.LEFT_DEVICE, 101, True)],
     WorkerPhase.AWAITING_START),
    # a crash while its chip is being reset: a new process would stop the reset, so back when the
    # controller says (the chip is back), like a rank that left its device
    (JobView(S.PAUSING, resetting=(1,)), -9, {}, [ProcessExit(1, -9, 101, True)], WorkerPhase.AWAITING_START),
    (JobView(S.PAUSING, resetting=(0,)), -9, {}, [ProcessExit(1, -9, 101, True), StartWorker(1, 1, "")],
     WorkerPhase.RUNNING),
    # its script cannot re-enter training at the step it restored: a new process would do the same
    (JobView(S.NORMAL), ExitCode.REWIND_REQUIRED, {}, [ProcessExit(1, ExitCode.REWIND_REQUIRED, 101, False)],
     WorkerPhase.FINAL),
    # it dumped on its own while the job goes on: fail the job now, the others dump while fresh
    (JobView(S.NORMAL), ExitCode.DUMPED, {}, [ProcessExit(1, ExitCode.DUMPED, 101, False)], WorkerPhase.FINAL),
    # it dumped because the job failed: nothing to report
    (JobView(S.FAILED), ExitCode.DUMPED, {}, [], WorkerPhase.FINAL),
    # a crash before every rank registered would crash again: the job fails
    (JobView(S.STARTING), 1, {}, [AbortJob("")], WorkerPhase.FINAL),
    # a crash after the job ended: not restarted
    (JobView(S.DONE), -9, {}, [], WorkerPhase.FINAL),
    # no view yet (a node whose link is still connecting): a crash is restarted
    (None, 1, {}, [ProcessExit(1, 1, 101, True), StartWorker(1, 1, "")], WorkerPhase.RUNNING),
    # unprotected: a failed rank ends the job as under msrun, with its code
    (None, 1, dict(protected=False, reports=False), [AbortJob("", exit_code=1)], WorkerPhase.FINAL),
    # MindIO's controller notices a lost rank itself: no report
    (JobView(S.NORMAL), -9, dict(reports=False), [StartWorker(1, 1, "")], WorkerPhase.RUNNING),
])
def test_a_worker_exit(view, code, kwargs, expected, phase) -> None:
    node = policy(view, **kwargs)
    got = decisions(node.on_exit(1, code))
    assert [_shape(e) for e in got] == [_shape(e) for e in expected]
    assert node.workers[1].phase is phase


def _shape(effect):
    """An effect without its words (reasons are for people; the table checks decisions)."""
    if isinstance(effect, StartWorker):
        return (StartWorker, effect.rank, effect.restarts, effect.renew_cluster)
    if isinstance(effect, AbortJob):
        return (AbortJob, effect.exit_code)
    return effect


def test_crashes_are_bounded_by_max_restarts_then_the_job_is_told_it_lost_the_rank() -> None:
    node = policy(max_restarts=2)
    for restart in (1, 2):
        assert StartWorker in {type(e) for e in node.on_exit(1, -9)}
        node.started(1, 200 + restart)
    last = decisions(node.on_exit(1, -9))
    assert last == [ProcessExit(1, -9, 202, False)] and node.workers[1].final


def test_restarts_of_every_worker_count_against_max_restarts_and_hot_resets_do_not() -> None:
    node = policy(JobView(S.REPAIRING, restart_all=True), max_restarts=1)
    node.on_order(RankOrder(0, OrderKind.KILL, "every worker restarts", pid=100))
    assert decisions(node.on_exit(0, -9)) == [ProcessExit(0, -9, 100, True)]
    node.on_order(RankOrder(0, OrderKind.START, "go"))
    node.started(0, 300)
    node.on_order(RankOrder(0, OrderKind.KILL, "every worker restarts", pid=300))
    # out of restarts: the job is told at once; its state stays for the dying gasp
    assert decisions(node.on_exit(0, -9)) == [ProcessExit(0, -9, 300, False)] and node.without_process() == [0]
    for _ in range(3):  # hot resets are the device plugin's to bound
        assert decisions(node.on_exit(1, ExitCode.LEFT_DEVICE)) == [ProcessExit(1, ExitCode.LEFT_DEVICE, 101, True)]
        node.on_order(RankOrder(1, OrderKind.START, "the chip is back"))
        node.started(1, 101)
    assert node.workers[1].restarts_used == 0


def test_crashes_count_across_restarts_of_every_worker() -> None:
    node = policy(JobView(S.NORMAL, restart_all=True), max_restarts=1)
    node.on_exit(1, -9)
    assert decisions(node.on_order(RankOrder(1, OrderKind.START, "every worker restarts")))[0].restarts == 1
    node.started(1, 300)
    assert decisions(node.on_exit(1, -9)) == [ProcessExit(1, -9, 300, False)] and node.workers[1].final


@pytest.mark.parametrize("order, expected", [
    (RankOrder(1, OrderKind.KILL, "HANG", pid=101, restart=True), [KillWorker(1, 101, "HANG")]),
    (RankOrder(1, OrderKind.KILL, "HANG", pid=0, restart=True), [KillWorker(1, 101, "HANG")]),
    (RankOrder(1, OrderKind.KILL, "an older process", pid=55), []),  # a newer process is left alone
    (RankOrder(1, OrderKind.START, "not stopped"), []),              # running: a late or repeated order
    (RankOrder(7, OrderKind.KILL, "not ours", pid=7), []),
])
def test_an_order_for_a_running_worker(order, expected) -> None:
    assert decisions(policy().on_order(order)) == expected


def test_a_kill_without_restart_waits_for_the_start_and_a_repeated_start_is_ignored() -> None:
    node = policy(JobView(S.REPAIRING, restart_all=True))
    assert decisions(node.on_order(RankOrder(1, OrderKind.KILL, "every worker restarts", pid=101))) == [
        KillWorker(1, 101, "every worker restarts")]
    assert decisions(node.on_exit(1, -9)) == [ProcessExit(1, -9, 101, True)]
    assert node.workers[1].awaiting_start and node.workers[1].restarts_used == 1  # a restart costs one
    started = decisions(node.on_order(RankOrder(1, OrderKind.START, "go")))
    assert [_shape(e) for e in started] == [(StartWorker, 1, 1, False)]
    node.started(1, 400)
    assert decisions(node.on_order(RankOrder(1, OrderKind.START, "go"))) == []


@pytest.mark.parametrize("code, view", [(ExitCode.LEFT_DEVICE, JobView(S.REPAIRING)),
                                         (-9, JobView(S.REPAIRING, restart_all=True))])
def test_a_start_for_the_process_that_left_before_its_exit_was_seen_starts_it_on_that_exit(code, view) -> None:
    node = policy(view)
    assert decisions(node.on_order(RankOrder(1, OrderKind.START, "device back", pid=101))) == []
    started = decisions(node.on_exit(1, code))
    assert [_shape(e) for e in started if isinstance(e, StartWorker)] == [(StartWorker, 1, 1, False)]
    node.started(1, 400)
    assert decisions(node.on_exit(1, ExitCode.LEFT_DEVICE)) == [ProcessExit(1, ExitCode.LEFT_DEVICE, 400, True)]


def test_a_repeated_start_for_an_older_process_is_not_kept_for_the_next_exit() -> None:
    node = policy(JobView(S.REPAIRING))
    assert decisions(node.on_order(RankOrder(1, OrderKind.START, "device back", pid=55))) == []
    assert node.workers[1].start_ordered is None
    assert decisions(node.on_exit(1, ExitCode.LEFT_DEVICE)) == [ProcessExit(1, ExitCode.LEFT_DEVICE, 101, True)]


def test_the_first_start_of_a_restart_of_every_worker_renews_the_cluster() -> None:
    node = policy(JobView(S.REPAIRING, restart_all=True))
    for rank in (0, 1):
        node.on_order(RankOrder(rank, OrderKind.KILL, "every worker restarts", pid=100 + rank))
        node.on_exit(rank, -9)
    first = decisions(node.on_order(RankOrder(0, OrderKind.START, "go")))
    node.started(0, 500)
    second = decisions(node.on_order(RankOrder(1, OrderKind.START, "go")))
    assert [_shape(e) for e in first + second] == [(StartWorker, 0, 1, True), (StartWorker, 1, 1, False)]


def test_no_start_while_the_node_is_interrupted() -> None:
    node = policy(JobView(S.REPAIRING))
    node.on_exit(1, ExitCode.LEFT_DEVICE)
    node.interrupted = True
    assert decisions(node.on_order(RankOrder(1, OrderKind.START, "device back"))) == []


LOG = "/logs/scheduler.log"
SPAWN_ERROR = "RuntimeError: Failed to initialize distributed job cluster because some processes in the cluster " \
              "are not successfully spawned."


@pytest.mark.parametrize("view, code, why, formed, kwargs, expected", [
    # it finished on its own: nothing to decide
    (JobView(S.NORMAL), 0, "", True, {}, []),
    # it formed the cluster and died while the ranks train: the controller restarts every worker behind a new one
    (JobView(S.NORMAL), -9, "", True, {}, [SchedulerLost(77, -9, "")]),
    (JobView(S.NORMAL, restart_all=True), 1, "[ERROR] lost", True, {}, [SchedulerLost(77, 1, "")]),
    (JobView(S.PAUSING), -9, "", True, {}, [SchedulerLost(77, -9, "")]),  # during another recovery too
    # it gave up before every worker joined (a script that never calls init()): the job fails, as before
    (JobView(S.NORMAL), 1, SPAWN_ERROR, False, {}, [AbortJob("")]),
    (JobView(S.STARTING), 1, SPAWN_ERROR, False, {}, [AbortJob("")]),
    # the job has not started, or finished: it fails
    (JobView(S.STARTING), -9, "", True, {}, [AbortJob("")]),
    (JobView(S.DONE), -9, "", True, {}, [AbortJob("")]),
    (None, -9, "", True, {}, [AbortJob("")]),
    # the job already failed: the ranks write their dying gasps, nothing to add
    (JobView(S.FAILED), -9, "", True, {}, []),
    # no controller to restart anything: unprotected, or MindIO's
    (None, -9, "", True, dict(protected=False, reports=False), [AbortJob("")]),
    (JobView(S.NORMAL), -9, "", True, dict(reports=False), [AbortJob("")]),
])
def test_the_schedulers_exit(view, code, why, formed, kwargs, expected) -> None:
    node = policy(view, **kwargs)
    got = decisions(node.on_scheduler_exit(77, code, why, LOG, formed))
    assert [_shape(e) for e in got] == [_shape(e) for e in expected]
    assert node.scheduler_lost is any(isinstance(e, SchedulerLost) for e in expected)


@pytest.mark.parametrize("code, why, formed, hint", [
    (1, SPAWN_ERROR, False, True),   # its own verdict that the workers never came
    (1, "[ERROR] Cluster topology timed out", False, True),
    (-9, "Topology build timed out., retry(3/120)", False, False),  # killed while forming: no verdict of its own
])
def test_a_scheduler_no_worker_joined_hints_at_no_scheduler_only_when_it_gave_up(code, why, formed, hint) -> None:
    node = policy()
    node.on_scheduler_exit(77, code, why, LOG, formed)
    assert node.failure is not None and ("--no-scheduler" in node.failure.reason) is hint
    assert LOG in node.failure.reason


def test_a_lost_scheduler_is_said_with_its_cause_and_renews_the_cluster_at_the_first_start() -> None:
    node = policy(JobView(S.NORMAL, restart_all=True))
    said = node.on_scheduler_exit(77, -9, "", LOG, formed=True)
    assert "killed by SIGKILL" in said[0].text and "no error line in its log" in said[0].text
    assert "every worker restarts behind a new scheduler (restart 1/2)" in said[0].text
    node.on_view(JobView(S.REPAIRING, restart_all=True))
    for rank in (0, 1):  # the controller stops every worker: a restart each
        node.on_order(RankOrder(rank, OrderKind.KILL, "every worker restarts", pid=100 + rank))
        node.on_exit(rank, -9)
    assert all(w.restarts_used == 1 for w in node.workers.values())
    first = decisions(node.on_order(RankOrder(0, OrderKind.START, "go")))
    node.started(0, 500)
    second = decisions(node.on_order(RankOrder(1, OrderKind.START, "go")))
    assert [_shape(e) for e in first + second] == [(StartWorker, 0, 1, True), (StartWorker, 1, 1, False)]
    assert not node.scheduler_lost and node.cluster_intact


def test_a_lost_scheduler_renews_the_cluster_in_a_job_that_restarts_single_ranks_too() -> None:
    node = policy(JobView(S.NORMAL))  # restart_all off: yet a new scheduler is needed
    node.on_scheduler_exit(77, -9, "", LOG, formed=True)
    for rank in (0, 1):
        node.on_order(RankOrder(rank, OrderKind.KILL, "every worker restarts", pid=100 + rank))
        node.on_exit(rank, -9)
    assert [_shape(e) for e in decisions(node.on_order(RankOrder(0, OrderKind.START, "go")))] == [
        (StartWorker, 0, 1, True)]


def test_scheduler_losses_are_bounded_by_max_restarts_then_the_job_fails_with_dying_gasps() -> None:
    node = policy(JobView(S.NORMAL, restart_all=True), max_restarts=1)
    assert decisions(node.on_scheduler_exit(77, -9, "", LOG, formed=True)) == [SchedulerLost(77, -9, "")]
    node.cluster_intact = True  # a new scheduler formed a new cluster
    last = decisions(node.on_scheduler_exit(78, -9, "", LOG, formed=True))
    assert last == [SchedulerLost(78, -9, "", will_restart=False)] and node.failure is None
    assert node.scheduler_losses == 2


def test_a_scheduler_that_dies_while_every_worker_is_stopped_for_a_restart_costs_no_restart() -> None:
    node = policy(JobView(S.REPAIRING, restart_all=True))
    for rank in (0, 1):
        node.on_order(RankOrder(rank, OrderKind.KILL, "every worker restarts", pid=100 + rank))
        node.on_exit(rank, -9)
    said = node.on_scheduler_exit(77, 1, "[ERROR] lost its workers", LOG, formed=True)
    assert decisions(said) == [] and "a new one starts with them" in said[0].text
    assert node.scheduler_losses == 0 and node.failure is None
    assert [_shape(e) for e in decisions(node.on_order(RankOrder(0, OrderKind.START, "go")))] == [
        (StartWorker, 0, 1, True)]


def test_a_replacement_node_rejoins_now_or_with_every_worker_or_not_at_all() -> None:
    assert NodePolicy.replaces_lost_node(S.REPAIRING, {0, 1, 2, 3}, [2, 3])
    assert not NodePolicy.replaces_lost_node(S.STARTING, {0, 1, 2, 3}, [2, 3])
    assert not NodePolicy.replaces_lost_node(S.NORMAL, {0, 1}, [2, 3])
    alone = NodePolicy((2, 3), 3, view=JobView(S.REPAIRING))
    assert [_shape(e) for e in decisions(alone.rejoin({2: 1, 3: 0}))] == [(StartWorker, 2, 2, False),
                                                                          (StartWorker, 3, 1, False)]
    together = NodePolicy((2, 3), 3, view=JobView(S.REPAIRING, restart_all=True))
    assert decisions(together.rejoin({2: 1, 3: 0})) == [] and all(w.awaiting_start for w in together.workers.values())
    ended = NodePolicy((2, 3), 3, view=JobView(S.FAILED, reason="no common step"))
    assert [_shape(e) for e in ended.rejoin({})] == [(AbortJob, None)]
    assert "no common step" in ended.failure.reason


def test_the_node_ends_when_its_ranks_are_final_and_waits_for_its_controllers_verdict() -> None:
    node = policy(runs_controller=True)
    for rank in (0, 1):
        node.on_exit(rank, 0)
    assert node.ending(10.0, None) is None  # the controller's verdict follows
    assert node.ending(10.0 + CONTROLLER_FINISH_TIMEOUT + 1, None).reason.startswith("every rank exited")
    assert node.exit_code(node.ending(11.0, ExitCode.OK)) == ExitCode.OK
    other = policy()
    for rank in (0, 1):
        other.on_exit(rank, 0)
    assert other.exit_code(other.ending(0.0, None)) == ExitCode.OK


def test_ranks_still_running_after_the_controller_finished_are_stopped_after_a_grace_period() -> None:
    node = policy(runs_controller=True)
    assert node.ending(0.0, ExitCode.FAILED) is None
    ending = node.ending(DUMP_GRACE_PERIOD + 1.0, ExitCode.FAILED)
    assert ending.stop_running
    for rank in (0, 1):
        node.stopped(rank, ExitCode.DUMPED)
    assert node.exit_code(ending) == ExitCode.DUMPED


def test_ranks_without_a_process_when_the_job_failed_are_dumped_by_the_agent() -> None:
    node = policy(JobView(S.REPAIRING))
    node.on_exit(1, ExitCode.LEFT_DEVICE)
    node.on_exit(0, ExitCode.DUMPED)
    assert node.without_process() == [1]
    node.dumped(1, ok=False)
    assert node.exit_code(node.ending(0.0, None)) == ExitCode.DUMP_FAILED


def test_a_node_without_the_controller_ends_once_the_job_failed_while_its_ranks_await_a_start() -> None:
    # Stopped so that every worker restarts, then the job failed: no START will come; the node
    # must end (and its agent dump them from memory) rather than wait for ever.
    node = policy(JobView(S.PAUSING, restart_all=True))
    for rank in (0, 1):
        node.on_order(RankOrder(rank, OrderKind.KILL, "every worker restarts", 100 + rank))
        node.on_exit(rank, -9)
    assert node.ending(0.0, None) is None  # they wait for their START
    node.on_view(JobView(S.FAILED, restart_all=True, dump_step=4))
    ending = node.ending(1.0, None)
    assert ending is not None and node.without_process() == [0, 1]
    for rank in (0, 1):
        node.dumped(rank, ok=True)
    assert node.exit_code(ending) == ExitCode.DUMPED


def test_every_rank_exiting_before_it_registered_fails_at_once_on_node_0() -> None:
    node = policy(JobView(S.STARTING), runs_controller=True)
    for rank in (0, 1):
        node.on_exit(rank, 0)
    ending = node.ending(0.0, None)
    assert ending is not None and "does the script use mindft" in ending.reason
    assert node.exit_code(ending) == ExitCode.FAILED


@pytest.mark.parametrize("controller, codes, expected", [
    (0, [0, 0], 0), (None, [3, 3], 3), (1, [3, 4], 4), (1, [0, -9], 1), (None, [0, -9], 137), (None, [0, 3], 3),
    (1, [3, 3], 3),
])
def test_job_exit_code(controller, codes, expected) -> None:
    assert job_exit_code(controller, codes) == expected


def test_a_dead_watcher_is_restarted_after_a_delay_then_given_up() -> None:
    watch = WatcherSupervision(delay=1.0, max_restarts=2)
    assert watch.on_dead(0.0) is False and watch.on_dead(0.5) is False and watch.on_dead(1.0) is True
    assert watch.on_dead(5.0) is False and watch.on_dead(6.0) is True
    assert "died 3 times" in watch.on_dead(9.0)


def test_when_no_start_will_come_the_node_ends_and_dumps_the_ranks_waiting_for_one() -> None:
    node = policy(JobView(S.REPAIRING), reports=False)  # MindIO: its stand-in failed the hot reset
    node.on_exit(1, ExitCode.LEFT_DEVICE)
    node.on_exit(0, ExitCode.DUMPED)
    assert node.ending(0.0, None) is None  # rank 1 waits for its START
    node.no_more_starts()
    ending = node.ending(1.0, None)
    assert ending is not None and node.without_process() == [1]
    node.dumped(1, ok=True)
    assert node.exit_code(ending) == ExitCode.DUMPED


def test_a_deterministic_failure_is_the_nodes_exit_code_unless_a_dying_gasp_failed() -> None:
    node = policy(JobView(S.FAILED, exit_code=ExitCode.FAILED))
    for rank in (0, 1):
        node.on_exit(rank, ExitCode.DUMPED)
    assert node.exit_code(Ending(ExitCode.FAILED)) == ExitCode.FAILED  # not 3: the script has a bug
    node.workers[1].returncode = ExitCode.DUMP_FAILED
    assert node.exit_code(Ending(ExitCode.FAILED)) == ExitCode.DUMP_FAILED


def test_a_rank_stopped_after_the_job_failed_waits_for_its_dying_gasp_from_memory() -> None:
    node = policy(JobView(S.FAILED, restart_all=True))
    said = node.on_order(RankOrder(1, OrderKind.KILL, "the job failed", pid=101))
    assert "(the job is over)" in said[0].text
    assert decisions(node.on_exit(1, -9)) == [] and node.without_process() == [1]
    assert node.workers[1].restarts_used == 0


def test_a_crash_while_a_controller_started_again_rebuilds_the_job_waits_for_its_start() -> None:
    """The job trained (a view past STARTING came); node 0 came back with a new controller, which
    says STARTING while it rebuilds the job: a crash then is no bad script, and no restart here."""
    node = policy(JobView(S.NORMAL))
    node.on_view(JobView(S.STARTING))
    assert node.under_way and node.rebuilding and not node.before_start
    assert decisions(node.on_exit(1, -9)) == [ProcessExit(1, -9, 101, True)]
    assert node.workers[1].awaiting_start
    fresh = policy(JobView(S.STARTING))
    assert fresh.before_start and not fresh.under_way and not fresh.rebuilding


@pytest.mark.parametrize("kwargs, asks", [
    (dict(reports=True, runs_controller=False), True),    # a node other than 0, under mindft's controller
    (dict(reports=True, runs_controller=True), False),    # node 0 runs the controller: its loss ends the job
    (dict(reports=False, runs_controller=False), False),  # MindIO's controller coordinates the job
    (dict(protected=False, reports=False), False),        # no fault tolerance
])
def test_only_an_agent_reporting_to_a_controller_elsewhere_may_replace_a_lost_node(kwargs, asks) -> None:
    assert NodePolicy((2, 3), 3, **kwargs).may_replace_lost_node is asks


def test_the_dying_gasps_step_and_reason_come_from_the_finished_controller_then_the_jobs_view() -> None:
    unheard = NodePolicy((0, 1), 3)
    assert (unheard.dump_step(None), unheard.failure_reason()) == (-1, "the job failed")
    node = policy(JobView(S.FAILED, dump_step=7, reason="no common step"))
    assert (node.dump_step(None), node.failure_reason()) == (7, "no common step")
    assert (node.dump_step(9), node.failure_reason("rank 1 out of restarts")) == (9, "rank 1 out of restarts")
    orphan = policy(JobView(S.NORMAL))
    for rank in (0, 1):
        orphan.on_exit(rank, ExitCode.DUMPED)  # they gave up on a controller that never said the job ended
    assert orphan.orphaned and orphan.failure_reason() == "the controller is gone (node 0 lost or cut off)"


def test_an_agent_says_hello_on_its_link_at_a_steady_pace_and_in_process_once() -> None:
    linked = NodePolicy((2, 3), 3)
    assert [linked.hello_due(t, in_process=False, interval=2.0) for t in (0.0, 1.0, 1.9, 2.0, 3.0, 4.5)] == [
        True, False, False, True, False, True]
    local = NodePolicy((0, 1), 3, runs_controller=True)
    assert [local.hello_due(t, in_process=True, interval=2.0) for t in (0.0, 2.0, 100.0)] == [True, False, False]


# ---- spares ----------------------------------------------------------------------------------

def spare_policy(view: Optional[JobView] = JobView(S.NORMAL, restart_all=True)) -> NodePolicy:
    node = NodePolicy((), 2, spare=True)
    if view is not None:
        node.on_view(view)
    return node


@pytest.mark.parametrize("view, ending", [
    (None, None), (JobView(S.NORMAL), None), (JobView(S.REPAIRING), None),
    (JobView(S.DONE), Ending(ExitCode.OK, reason="the job is done: this spare was not needed")),
    (JobView(S.FAILED, reason="PAUSING timed out"), Ending(ExitCode.FAILED)),
])
def test_a_spare_waits_until_the_job_ends_and_writes_no_dying_gasp(view, ending) -> None:
    node = spare_policy(view)
    assert node.ending(10.0, None) == ending
    assert not node.writes_dying_gasp
    if ending is not None:
        assert node.exit_code(ending) == ending.controller


def test_a_spare_leaves_once_its_controller_was_silent_longer_than_a_rank_would_wait() -> None:
    node = spare_policy()
    assert node.controller_silent(30.0, 30.0) == []
    (abort,) = decisions(node.controller_silent(30.5, 30.0))
    assert isinstance(abort, AbortJob) and "said nothing for 30 s (> 30 s): this spare leaves" in abort.reason
    assert node.ending(40.0, None) == Ending(ExitCode.FAILED, reason=abort.reason)
    assert policy().controller_silent(100.0, 30.0) == []  # an agent with ranks leaves with them


def test_a_spare_that_adopts_a_node_starts_its_ranks_with_every_worker() -> None:
    node = spare_policy()
    node.adopt(range(2, 4))
    assert not node.spare and sorted(node.workers) == [2, 3] and node.hello_due(0.0, False, 2.0)
    out = node.rejoin({2: 1, 3: 1})
    assert decisions(out) == [] and all(w.awaiting_start for w in node.workers.values())
    (start,) = decisions(node.on_order(RankOrder(2, OrderKind.START, "every worker restarts",
                                                 restore_from="tcp://10.0.0.1:5")))
    assert (start.rank, start.restarts, start.restore_from) == (2, 2, "tcp://10.0.0.1:5")


def test_an_agent_whose_node_was_given_away_becomes_a_spare() -> None:
    node = policy()
    out = node.replaced("node 0 was given to a spare")
    assert [type(e).__name__ for e in out] == ["Say", "BecomeSpare"]
    node.spare_again()
    assert node.spare and node.workers == {} and node.ranks == ()
    assert node.replaced("again") == []  # a spare has nothing to give up
    node.on_view(JobView(S.DONE))
    assert node.ending(1.0, None) is not None


def test_a_rank_that_dies_in_mindspores_teardown_after_the_job_finished_is_no_failure() -> None:
    """The controller said DONE (every rank's final state written and acknowledged); a rank then
    killed by SIGSEGV inside MindSpore's teardown leaves the node's exit code 0, said as what it is."""
    node = policy(JobView(S.DONE))
    out = node.on_exit(1, -11)
    assert decisions(out) == [] and any("after the job finished (in MindSpore's teardown)" in e.text
                                        for e in out if isinstance(e, Say))
    node.on_exit(0, 0)
    ending = node.ending(1.0, None)
    assert ending is not None and node.exit_code(ending) == ExitCode.OK
    failing = policy(JobView(S.NORMAL))
    failing.on_exit(1, -11)  # while the job trains, the same death is a fault
    assert failing.workers[1].returncode == -11
