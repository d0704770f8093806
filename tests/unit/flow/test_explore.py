"""The simulated job: named fault schedules, then thousands of seeded random ones.

Every run checks, as it goes: only table transitions; recovery rounds never go back; the rank
table's per-state counts match a recount after every input (the job's end needs them); every
rank restores (and dumps) only a step it holds; every recovery ends in NORMAL or FAILED
before its deadlines; no message after the job ended; a rank on a chip being reset leaves it
(the simulated plugin waits for that, as the real one does, and isolates the chip after 60 s)
and is started again only once the chip is back; at the end, DONE with every model
exact, or FAILED only when an unrecoverable fault was scheduled, with every rank gone. Some
jobs run on two nodes whose agents replicate, and lose one: a FAILED end then needs that no
step was common to the lost ranks' replicas and the other ranks.
"""
from __future__ import annotations

import logging

import pytest

from mindft.exitcodes import ExitCode
from mindft.flow import Follower, JobState, RankState
from mindft.protocol import FaultKind
from explore import check_explored, explore, random_job
from sim import PHASES, SimJob, Violation



@pytest.fixture(autouse=True)
def quiet_flow_logs():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def finished(job: SimJob) -> SimJob:
    job.run()
    job.check_end()
    return job


def test_fault_free_job_finishes() -> None:
    job = finished(SimJob(3, 8, seed=1))
    assert job.outcome.exit_code == ExitCode.OK and job.job.recoveries == []


@pytest.mark.parametrize("every", [1, 2, 3])
def test_a_reported_fault_rolls_every_rank_back_once(every: int) -> None:
    job = finished(SimJob(4, 9, seed=2, snapshot_every=every).fail_at(2, 5))
    assert len(job.job.recoveries) == 1
    assert job.job.recovery.repair_step % every == 0 and job.job.recovery.repair_step <= 4


def test_a_killed_rank_restarts_from_agent_held_snapshots() -> None:
    job = finished(SimJob(3, 8, seed=3).kill_at(1, 4))
    assert job.ranks[1].incarnation == 1 and len(job.job.recoveries) == 1


def test_a_rank_killed_again_after_its_restart_is_restarted_again() -> None:
    job = finished(SimJob(2, 8, seed=4).kill_at(0, 3).kill_at(0, 5, incarnation=1))
    assert job.ranks[0].incarnation == 2


def test_a_device_reset_waits_for_the_chip() -> None:
    job = finished(SimJob(2, 8, seed=5).device_reset_at(1, 4, seconds=2.0))
    assert job.job.recoveries[0] >= 2.0
    assert (JobState.REPAIRING, JobState.ROLLBACK) in {(a, b) for a, b, _ in job.transitions}


def test_a_failed_device_ends_the_job_with_every_rank_dumping_one_step() -> None:
    job = finished(SimJob(3, 8, seed=6).device_reset_at(0, 4, fails=True))
    assert job.outcome.exit_code == ExitCode.FAILED
    assert "could not be recovered" in job.outcome.reason and "every rank dumps step" in job.outcome.reason
    # Rank 0 had left its chip for the reset (its snapshots stay with the node agent); the others dump.
    assert [r.exit_code for r in job.ranks.values()] == [ExitCode.LEFT_DEVICE, ExitCode.DUMPED, ExitCode.DUMPED]


def test_two_faults_in_one_run() -> None:
    job = finished(SimJob(3, 9, seed=7).fail_at(0, 3).fail_at(2, 7, FaultKind.COMMUNICATION))
    assert len(job.job.recoveries) == 2


def test_the_explorer_catches_a_broken_window(monkeypatch) -> None:
    # Without the window a fast rank overwrites the step a slow one still needs.
    monkeypatch.setattr(Follower, "may_capture", lambda self, step: True)
    with pytest.raises(AssertionError, match="FAILED though every fault was recoverable"):
        explore(range(200))


def test_the_explorer_catches_ranks_that_stay_on_a_device_being_reset(monkeypatch) -> None:
    from mindft.flow.ladder import Ladder
    monkeypatch.setattr(Ladder, "_leave_devices", lambda self, now: None)
    with pytest.raises(AssertionError, match="chip is being reset|still on its device"):
        explore(range(300))


def test_the_explorer_catches_state_counts_out_of_sync(monkeypatch) -> None:
    # The job ends when the table counts every rank DONE; a state change the counts miss
    # (here: every change to DONE and back) is caught where it happens.
    from mindft.flow import ranks
    real = ranks._CountedState.__set__

    def set_uncounted_done(self, record, state) -> None:
        if state is RankState.DONE or record.__dict__.get("state") is RankState.DONE:
            record.__dict__["state"] = state
        else:
            real(self, record, state)
    monkeypatch.setattr(ranks._CountedState, "__set__", set_uncounted_done)
    with pytest.raises(AssertionError, match="a recount finds"):
        explore(range(50))


def test_the_explorer_catches_ranks_down_and_broadcast_peers_out_of_sync(monkeypatch) -> None:
    # A round waits for the live ranks and broadcasts to their peers, both kept as records flip alive:
    # a flip the table misses is caught where it happens.
    from mindft.flow.ranks import RankTable
    monkeypatch.setattr(RankTable, "_flipped", lambda self, rank, alive: None)
    with pytest.raises(AssertionError, match="wrong side of alive|kept broadcast peers"):
        explore(range(50))


def test_a_hot_reset_restarts_the_rank_from_agent_memory_after_its_device_is_back() -> None:
    job = finished(SimJob(3, 8, seed=9).device_reset_at(1, 4, seconds=2.0))
    assert job.ranks[1].incarnation == 1 and job.ranks[1].exit_code == ExitCode.OK


def test_the_simulator_flags_a_restore_of_a_step_not_held() -> None:
    job = SimJob(2, 4, seed=8)
    with pytest.raises(Violation, match="holds"):
        job.ranks[0].restore(3)


# The fast tier explores the first thousand seeds; the slow tier the other nine thousand
# (tests/integration/flow/test_explore_seeds.py).
def test_seeded_schedules() -> None:
    check_explored(range(1_000))


@pytest.mark.parametrize("seed", range(5))
def test_a_second_hot_reset_while_a_rank_leaves_its_chip_ends_exact(seed: int) -> None:
    job = finished(SimJob(4, 8, seed=seed).device_reset_at(1, 4).fault_in_phase("leaving", 2))
    assert job.phase_hits["leaving"] == 1 and job.outcome.exit_code == ExitCode.OK
    assert job.ranks[1].incarnation == job.ranks[2].incarnation == 1


@pytest.mark.parametrize("phase", ["pausing", "rollback"])
def test_collectives_a_chip_reset_during_a_recovery_in_place_restarts_every_worker(phase: str) -> None:
    job = finished(SimJob(3, 8, seed=11, collectives=True).fail_at(0, 3).fault_in_phase(phase, 0))
    assert job.phase_hits[phase] == 1 and job.outcome.exit_code == ExitCode.OK
    incarnations = {rank.incarnation for rank in job.ranks.values()}
    assert len(incarnations) == 1 and incarnations != {0}  # every worker restarted, together


def test_the_explorer_catches_a_round_that_waits_for_a_rank_told_to_leave(monkeypatch) -> None:
    from mindft.flow.ladder import Ladder
    monkeypatch.setattr(Ladder, "_answering", lambda self: {r.rank for r in self.ranks if r.alive})
    with pytest.raises(AssertionError, match="waits for rank .*told to leave"):
        explore(range(1_000))


def test_a_seed_replays_the_same_schedule() -> None:
    first, second = finished(random_job(1234)), finished(random_job(1234))
    assert first.transitions == second.transitions


# ---- data-parallel jobs: every step ends in a collective that a restarted process cannot rejoin ----

def test_collectives_a_killed_rank_restarts_every_worker_from_agent_memory() -> None:
    job = finished(SimJob(3, 8, seed=11, collectives=True).kill_at(1, 4))
    assert [r.incarnation for r in job.ranks.values()] == [1, 1, 1]
    assert len(job.job.recoveries) == 1 and job.job.recovery.restart_all


def test_collectives_a_fault_before_the_all_reduce_restarts_every_worker_after_the_stall() -> None:
    job = finished(SimJob(3, 8, seed=12, collectives=True).fail_at(1, 4))
    # Its peers wait in step 4's all-reduce and never pause: timeouts.stall, then every worker restarts.
    assert [r.incarnation for r in job.ranks.values()] == [1, 1, 1]
    assert job.job.recoveries[0] >= job.timeouts.stall


def test_collectives_a_hot_reset_stops_every_worker_and_starts_them_when_the_chip_is_back() -> None:
    job = finished(SimJob(2, 8, seed=13, collectives=True).device_reset_at(1, 4, seconds=2.0))
    assert [r.incarnation for r in job.ranks.values()] == [1, 1]
    assert job.job.recoveries[0] >= 2.0


def test_collectives_a_failed_device_dumps_one_step() -> None:
    job = finished(SimJob(3, 8, seed=14, collectives=True).device_reset_at(0, 4, fails=True))
    assert job.outcome.exit_code == ExitCode.FAILED and "every rank dumps step" in job.outcome.reason


def test_the_explorer_catches_restarting_one_rank_of_a_collective_job(monkeypatch) -> None:
    from mindft.flow.ladder import Ladder
    monkeypatch.setattr(Ladder, "restart_every_worker", Ladder.enter_pausing)
    with pytest.raises(AssertionError, match="FAILED though every fault was recoverable|did not end"):
        explore(range(300))


# ---- MindSpore's scheduler dies: every worker restarts behind a new one ----

@pytest.mark.parametrize("nodes", [1, 2])
def test_collectives_a_lost_scheduler_restarts_every_worker_behind_a_new_one(nodes: int) -> None:
    for seed in range(20):
        job = finished(SimJob(4, 8, seed=seed, collectives=True).spread(nodes).lose_scheduler_at(5))
        assert job.outcome.exit_code == ExitCode.OK, job.outcome.reason
        assert [r.incarnation for r in job.ranks.values()] == [1, 1, 1, 1] and job.schedulers == 2
        assert len(job.job.recoveries) == 1


def test_collectives_a_scheduler_lost_during_a_recovery_and_again_after_it() -> None:
    for seed in range(20):
        job = finished(SimJob(3, 9, seed=seed, collectives=True).kill_at(1, 4).lose_scheduler_at(4)
                       .lose_scheduler_at(7))
        assert job.outcome.exit_code == ExitCode.OK, job.outcome.reason
        assert job.schedulers_lost == 2 and job.schedulers >= 3


def test_the_explorer_catches_a_start_behind_a_dead_scheduler(monkeypatch) -> None:
    import dataclasses
    from mindft.flow.agent import NodePolicy, StartWorker
    real = NodePolicy.on_order

    def never_renews(self, order):
        return [dataclasses.replace(e, renew_cluster=False) if isinstance(e, StartWorker) else e
                for e in real(self, order)]
    monkeypatch.setattr(NodePolicy, "on_order", never_renews)
    with pytest.raises(AssertionError, match="with MindSpore's scheduler dead"):
        explore(range(300))


def test_the_explorer_catches_an_agent_that_keeps_a_lost_scheduler_to_itself(monkeypatch) -> None:
    from mindft.flow.agent import NodePolicy
    from mindft.flow.inputs import SchedulerLost
    real = NodePolicy.on_scheduler_exit
    # The ranks wait in a collective of the dead cluster for ever, heartbeating: nothing else ends it.
    monkeypatch.setattr(NodePolicy, "on_scheduler_exit", lambda self, *args, **kwargs: [
        e for e in real(self, *args, **kwargs) if not isinstance(e, SchedulerLost)])
    with pytest.raises(AssertionError, match="did not end"):
        explore(range(300))


def test_the_explorer_catches_a_job_that_ignores_a_lost_scheduler(monkeypatch) -> None:
    from mindft.flow import lost
    monkeypatch.setattr(lost, "scheduler_lost", lambda ladder, event, now: None)
    with pytest.raises(AssertionError, match="did not end|every fault was recoverable|scheduler dead"):
        explore(range(300))


# ---- the cadence chosen by the job within an overhead budget ----

def test_budget_jobs_change_cadence_and_stay_exact() -> None:
    from mindft.flow.cadence import Budget
    changed = 0
    for seed in range(40):
        job = finished(SimJob(3, 24, seed=seed, budget=Budget(max_replay=5)).fail_at(1, 17))
        changed += len(job.job.tuner.schedule.segments) > 1
    assert changed >= 20  # most runs switched cadence at least once, and every model is exact


def test_the_explorer_catches_a_cadence_switch_too_early(monkeypatch) -> None:
    # Switching at the next capture step after the slowest rank: a fast rank has already
    # decided it (or a later step) under the old cadence.
    from mindft.flow.cadence import Schedule
    monkeypatch.setattr(Schedule, "switch_point", lambda self, slowest, keep=2: self.after(self.at_or_before(slowest)))
    with pytest.raises(AssertionError, match="already decided"):
        explore(range(2000))


# ---- nodes lost with their agents' memory: the rollback step is one the replicas hold ----

def lost_node_jobs(collectives: bool, speed: int = 3, seeds: range = range(60)) -> list[SimJob]:
    return [SimJob(4, 10, seed=seed, collectives=collectives).spread(2, replica_speed=speed)
            .lose_node_at(1, 6, replace_after=2.0) for seed in seeds]


@pytest.mark.parametrize("collectives", [False, True])
def test_a_lost_node_recovers_from_its_replicas_or_ends_with_dying_gasps(collectives: bool) -> None:
    ends = {"done": 0, "failed": 0}
    for job in lost_node_jobs(collectives):
        finished(job)  # a FAILED end is checked: no step was common to the replicas and the others
        if job.outcome.exit_code == ExitCode.OK:
            ends["done"] += 1
            # Rolled back to the replica's step: the new processes of the lost node held nothing else.
            assert [job.ranks[r].incarnation >= 1 for r in (2, 3)] == [True, True]
        else:
            ends["failed"] += 1
            assert "can roll back" in job.outcome.reason or "no step is held by every rank" in job.outcome.reason
    assert ends["done"] >= 10 and ends["failed"] >= 5, ends  # both ends are explored


# ---- node 0 lost with the controller: a new one rebuilds the job from what survived ----

# A job with collectives has no "leaving" phase: its ranks are killed, none leaves its chip on its own.
@pytest.mark.parametrize("phase, collectives, standby, relays",
                         [(phase, collectives, standby, relays) for standby in (False, True)
                          for relays in (False, True) for collectives in (False, True)
                          for phase in ("normal", *PHASES)
                          if not (collectives and phase == "leaving") and (standby or not relays)])
def test_node_0_lost_with_the_controller_in_any_phase_ends_exact(phase: str, collectives: bool,
                                                                 standby: bool, relays: bool) -> None:
    """One rank per node, as on the two-host runs: node 0 (the controller, its agent's memory, rank 0)
    is lost while the job trains or when an episode (rank 1 killed, faulted or its chip reset)
    reaches ``phase``, and comes back 0.5–6 s later: the new controller (node 0's, or a standby that
    commands nothing until half of the node agents said hello to it) restarts every worker, rank 0
    from its replica, and the job ends DONE with every model exact (the simulator checks it). With
    ``relays``, each node's agent relays its rank's traffic (node 0's relay is lost with it)."""
    ends = {"done": 0, "failed": 0}
    for seed in range(40):
        job = SimJob(2, 10, seed=seed, collectives=collectives, standby=standby,
                     relays=relays).spread(2, replica_speed=3)
        back = 0.5 + seed % 12 * 0.5
        if phase == "normal":
            job.lose_node_at(0, 3 + seed % 6, replace_after=back)
        else:
            (job.kill_at(1, 4), job.fail_at(1, 4), job.device_reset_at(1, 4, seconds=1.0))[seed % 3]
            job.fault_in_phase(phase, 0, "node", seconds=back)
        finished(job)
        if phase == "normal" or job.phase_hits[phase]:
            assert job.controllers == 2, (seed, job.transitions)
            ends["done" if job.outcome.exit_code == ExitCode.OK else "failed"] += 1
    # One rank per node: the replica of rank 0 is always of a step rank 1 still holds, so every
    # run recovers (none gives up), and the phase was reached in most.
    assert ends["failed"] == 0 and ends["done"] >= 30, ends


def test_the_explorer_catches_a_controller_that_starts_afresh_a_job_under_way(monkeypatch) -> None:
    # A new controller that does not look at what survived starts node 0's new process beside the
    # old one of node 1, which waits in the old cluster's collective: the job never ends.
    from mindft.flow.rejoin import Survivors

    monkeypatch.setattr(Survivors, "under_way", property(lambda self: False))
    with pytest.raises(AssertionError, match="did not end"):
        finished(SimJob(2, 10, seed=1, collectives=True).spread(2, replica_speed=3).lose_node_at(0, 5))


def test_replicas_that_never_arrive_end_with_dying_gasps_at_once() -> None:
    for seed in range(10):
        job = finished(SimJob(4, 10, seed=seed).spread(2, replica_drop=1.0).lose_node_at(1, 6))
        assert job.outcome.exit_code == ExitCode.FAILED
        assert "rank 2 only to nothing (no replica), rank 3 only to nothing (no replica)" in job.outcome.reason
        assert all(job.ranks[r].exit_code == ExitCode.DUMPED for r in (0, 1))


def test_the_explorer_catches_a_rollback_to_a_step_the_replica_does_not_hold(monkeypatch) -> None:
    # A flow that chooses the rollback step from the surviving ranks alone, as if the lost
    # node's ranks held what they held before: their new processes hold only their replicas.
    from mindft.flow.ladder import Ladder

    def survivors_decide(self, exact):
        lost = {r for r, f in self.recovery.faults.items() if f.node >= 0}
        held = [frozenset(r.held) for r in self.ranks if r.rank not in lost]
        common = frozenset.intersection(*held) if held else frozenset()
        return max(common) if common else -1

    monkeypatch.setattr(Ladder, "_common_step", survivors_decide)
    monkeypatch.setattr(Ladder, "replicas_fall_short", lambda self, now, others=True: False)
    with pytest.raises(AssertionError, match="told to restore step .* but holds"):
        for job in lost_node_jobs(collectives=False, seeds=range(200)):
            finished(job)


def test_the_explorer_catches_a_flow_that_gives_up_on_every_lost_node(monkeypatch) -> None:
    from mindft.flow.ladder import Ladder

    def give_up(self, now, others=True):
        if any(f.replica is not None and f.process_pending for f in self.recovery.faults.values()):
            self.fail("a node was lost", now)
            return True
        return False

    monkeypatch.setattr(Ladder, "replicas_fall_short", give_up)
    # (In an elastic job that grows, the rank that joins from a peer's copy is given up on too.)
    with pytest.raises(AssertionError, match="FAILED after a node loss though every rank could restore step|"
                                             "FAILED after it grew"):
        explore(range(2000))


# ---- the node agents' rules (mindft.flow.agent), which the simulator runs as they are ----

def test_the_explorer_catches_an_agent_that_restarts_a_rank_that_left_its_device(monkeypatch) -> None:
    from mindft.exitcodes import ExitCode
    from mindft.flow.agent import NodePolicy
    real = NodePolicy.on_exit
    # Without the rule, leaving the device looks like a crash: restarted at once, on the chip being reset.
    monkeypatch.setattr(NodePolicy, "on_exit", lambda self, rank, code: real(self, rank, 1 if code ==
                                                                             ExitCode.LEFT_DEVICE else code))
    monkeypatch.setattr(NodePolicy, "resetting", lambda self, rank: False)
    with pytest.raises(AssertionError, match="started on its device while the device is reset"):
        explore(range(300))


def test_the_explorer_catches_an_agent_that_restarts_a_crash_on_a_chip_being_reset(monkeypatch) -> None:
    from mindft.flow.agent import NodePolicy
    monkeypatch.setattr(NodePolicy, "resetting", lambda self, rank: False)
    with pytest.raises(AssertionError, match="started on its device while the device is reset"):
        explore(range(1_000))


def test_the_explorer_catches_an_agent_that_restarts_one_rank_of_a_collective_job(monkeypatch) -> None:
    from mindft.flow.agent import NodePolicy
    # The restarted process cannot join its peers' communicator: they wait in the all-reduce for ever.
    monkeypatch.setattr(NodePolicy, "restart_all", property(lambda self: False))
    with pytest.raises(AssertionError, match="did not end|every fault was recoverable"):
        explore(range(300))
