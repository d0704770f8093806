"""The simulated elastic job (tests/sim_elastic.py): named schedules of nodes lost for good, nodes back
and spares, faults while the world changes; then rules broken on purpose, which the simulator catches.

Besides tests/sim.py's invariants, every run checks: a shrink leaves behind only nodes really gone and
keeps at least MIN; a growth stays within MAX, its agents stop their ranks only once their memory
holds the boundary step and the new world rolls back to no step before it; every rank of the final
world ends with the state of a fault-free run (one that joined from a peer's copy too); a job FAILED
with a node lost only when fewer than MIN nodes were left.
"""
from __future__ import annotations

import logging
import math

import pytest

from mindft.exitcodes import ExitCode
from sim import RESIZING, SimJob, expected_state


@pytest.fixture(autouse=True)
def quiet_flow_logs():
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def elastic(seed: int, nodes: int = 3, nproc: int = 1, least: int = 2, collectives: bool = False,
            steps: int = 30) -> SimJob:
    return SimJob(nodes * nproc, steps, seed=seed, collectives=collectives, elastic=(least, nodes),
                  shrink_after=3.0).spread(nodes, replica_speed=3)


def finished(job: SimJob) -> SimJob:
    job.run()
    job.check_end()
    return job


def exact(job: SimJob) -> bool:
    return all(rank.exit_code == ExitCode.OK and rank.model == expected_state(job.steps) for rank in job.ranks.values())


@pytest.mark.parametrize("nproc, collectives", [(1, False), (2, False), (1, True), (2, True)])
def test_a_node_lost_for_good_is_left_behind_and_the_others_end_exact(nproc: int, collectives: bool) -> None:
    for seed in range(5):
        job = finished(elastic(seed, nproc=nproc, collectives=collectives).lose_node_at(1, 5, math.inf))
        assert job.outcome.exit_code == ExitCode.OK and exact(job), job.outcome.reason
        assert (job.nodes, job.world_size, job.world.shrinks, job.job.term) == (2, 2 * nproc, 1, 1)
        assert all(rank.incarnation >= 1 for rank in job.ranks.values())  # restarted from their agents' memory
        assert "node 1 lost for good" in job.job.resizes[0].reason and "renumbered 2→1" in job.job.resizes[0].reason


@pytest.mark.parametrize("nproc, collectives", [(1, False), (2, True)])
def test_a_spare_after_the_shrink_joins_at_a_snapshot_boundary_from_a_peers_copy(nproc: int,
                                                                                 collectives: bool) -> None:
    grown = 0
    for seed in range(6):
        job = elastic(seed, nproc=nproc, collectives=collectives, steps=40).lose_node_at(2, 5, math.inf)
        job.world.spare_after_shrink(0.2)
        finished(job)
        assert job.outcome.exit_code == ExitCode.OK and exact(job), job.outcome.reason
        if job.world.growths:
            grown += 1
            assert (job.nodes, job.job.term) == (3, 2)
            assert "a spare joins as node 2" in job.job.resizes[1].reason
    assert grown >= 4  # in the others the job ended before its next snapshot boundary


def test_the_launcher_of_a_node_left_behind_is_told_so_and_the_job_grows_by_it() -> None:
    grown = 0
    for seed in range(6):
        job = finished(elastic(seed, steps=60).lose_node_at(1, 5, replace_after=10.5))
        assert job.outcome.exit_code == ExitCode.OK and exact(job), job.outcome.reason
        assert job.world.shrinks == 1 and job.world.links >= 1  # its launcher came back as a new agent
        grown += job.world.growths
    assert grown >= 3


def test_a_launcher_back_before_the_job_shrinks_replaces_its_node_as_without_elasticity() -> None:
    for seed in range(5):
        job = finished(elastic(seed, nproc=2).lose_node_at(1, 5, replace_after=1.0))
        assert job.world.shrinks == 0 and job.nodes == 3
        assert job.outcome.exit_code == ExitCode.OK or "can roll back" in job.outcome.reason


def test_a_spare_there_when_a_node_is_lost_takes_it_and_nothing_shrinks() -> None:
    for seed in range(5):
        job = elastic(seed, steps=40).lose_node_at(1, 5, math.inf)
        job.world.spare_at(0.01)
        finished(job)  # its ranks from their replicas, if the others still hold the step they restore
        assert job.world.shrinks == 0 and job.nodes == 3 and job.job.spares.adoptions
        assert job.outcome.exit_code == ExitCode.OK or "can roll back" in job.outcome.reason


@pytest.mark.parametrize("least, lose", [(3, (1,)), (2, (1, 2))])
def test_below_min_nothing_shrinks_the_job_waits_then_ends_with_its_dying_gasps(least: int, lose: tuple) -> None:
    for seed in range(3):
        job = elastic(seed, least=least)
        for node in lose:
            job.lose_node_at(node, 5, math.inf)
        finished(job)
        assert job.world.shrinks == 0 and job.outcome.exit_code == ExitCode.FAILED
        assert "timed out" in job.outcome.reason and job.job.below_min == lose
        assert [job.ranks[0].exit_code] == [ExitCode.DUMPED]


@pytest.mark.parametrize("collectives", [False, True])
def test_a_rank_killed_while_the_job_resizes_restarts_and_ends_exact(collectives: bool) -> None:
    hits = 0
    for seed in range(6):
        job = elastic(seed, nproc=2, collectives=collectives).lose_node_at(1, 5, math.inf)
        finished(job.fault_in_phase(RESIZING, seed % 4, "kill"))
        hits += job.phase_hits[RESIZING]
        assert job.outcome.exit_code == ExitCode.OK and exact(job) and job.nodes == 2, job.outcome.reason
    assert hits >= 4


def test_a_second_node_lost_for_good_while_the_job_shrinks_is_left_behind_too() -> None:
    for seed in range(6):
        job = elastic(seed, nodes=4, least=2).lose_node_at(1, 5, math.inf)
        finished(job.fault_in_phase(RESIZING, 2, "node", seconds=math.inf))  # node 3, node 2 of the new world
        assert job.phase_hits[RESIZING] == 1
        assert job.outcome.exit_code == ExitCode.OK and exact(job), job.outcome.reason
        assert job.nodes == 2 and job.world.shrinks == 2


def test_a_second_node_lost_while_the_job_shrinks_to_min_ends_with_dying_gasps() -> None:
    for seed in range(3):
        job = elastic(seed, nodes=3, least=2).lose_node_at(1, 5, math.inf)
        finished(job.fault_in_phase(RESIZING, 1, "node", seconds=math.inf))  # node 2, node 1 of the new world
        assert job.outcome.exit_code == ExitCode.FAILED and job.world.shrinks == 1


# ---- rules broken on purpose --------------------------------------------------------------------

def test_the_simulator_catches_a_shrink_below_min(monkeypatch) -> None:
    from mindft.flow.elastic import ElasticRange
    monkeypatch.setattr(ElasticRange, "shrink", lambda self, nnodes, lost: tuple(
        node for node in range(nnodes) if node not in lost) if lost else None)
    with pytest.raises(AssertionError, match="MIN 3"):
        finished(elastic(1, least=3).lose_node_at(1, 5, math.inf))


def test_the_simulator_catches_a_growth_between_snapshots(monkeypatch) -> None:
    from mindft.flow import JobState, Resize, elastic as rules

    def at_any_step(job, now) -> None:  # grow_when_spare without its snapshot boundary
        nproc, spares = job.nproc, job.spares.live_spares(now)
        if job.resized is None and job.state is JobState.NORMAL and nproc and spares and \
                job.ranks.world_size // nproc < job.elastic.max_nodes and job.ranks.slowest > job.trained_before:
            nnodes = job.ranks.world_size // nproc
            rules._resize(job, Resize(tuple(range(nnodes)), nproc, job.term + 1, (), "at any step",
                                      joins=(spares[0],)), job.ranks.slowest)

    monkeypatch.setattr(rules, "grow_when_spare", at_any_step)
    with pytest.raises(AssertionError, match="which its memory does not hold"):
        for seed in range(20):
            job = SimJob(2, 40, seed=seed, snapshot_every=3, elastic=(2, 3)).spread(2, replica_speed=3)
            job.world.spare_at(0.01)
            finished(job)


def test_the_simulator_catches_a_joining_rank_that_copies_the_newest_peer(monkeypatch) -> None:
    from mindft.flow.rejoin import Replica, Survivors

    def newest(self):
        peers = [(said.newest, rank, said.node) for rank, said in self.agents.items()
                 if rank < self.joining and said.newest >= 0 and said.node in self.keepers]
        if not peers:
            return None
        step, rank, node = max(peers)
        return Replica(self.keepers[node], step, node, rank)

    monkeypatch.setattr(Survivors, "copy", newest)
    with pytest.raises(AssertionError, match="FAILED after it grew"):
        for seed in range(40):
            job = elastic(seed, nproc=2, steps=40).lose_node_at(2, 5, math.inf)
            job.world.spare_after_shrink(0.2)
            finished(job)
