"""Standby controllers in the flow (:mod:`mindft.flow.standby`): when a node agent follows the next
candidate, what a term refuses, when a standby takes command; then a standby Job, from the
survivors' hellos to the rebuild with a spare for node 0."""
from __future__ import annotations

import pytest

from mindft.flow import Fence, GiveNode, JobState, KillRank, Promoted, StartRank
from mindft.flow.standby import (Failover, Move, candidates, promotes, rank_retries, takeover_after)
from mindft.protocol import AgentHello, JobView, ProcessExit, Register, Replaced, Superseded
from test_job import T
from mindft.flow.job import Job

S = JobState
NODE1, NODE2 = "tcp://10.0.0.2:29601", "tcp://10.0.0.3:29601"
LOCAL, SPARE = b"", b"agent/-1/20"


def test_a_standby_takes_over_well_within_a_ranks_patience() -> None:
    assert takeover_after(2.0, 5) == 4.0 and takeover_after(3.0, 10) == 15.0
    assert takeover_after(2.0, 1) == 4.0  # never less than two silent periods
    assert rank_retries(5, 0) == 5 and rank_retries(5, 1) == 10  # the ranks wait for the rebuild
    for dead_after, retries in ((2.0, 5), (3.0, 10), (0.5, 3)):
        assert takeover_after(dead_after, retries) < dead_after * rank_retries(retries, 1) / 2


@pytest.mark.parametrize("standbys, node, expected", [(0, 0, ()), (1, 0, (1,)), (2, 0, (1, 2)), (2, 1, (2,)),
                                                      (2, 2, ()), (5, 0, (1, 2))])
def test_the_candidates_are_the_next_nodes_up_to_two(standbys: int, node: int, expected: tuple) -> None:
    assert candidates(standbys, node) == expected


@pytest.mark.parametrize("heard, nnodes, takes", [(1, 2, True), (0, 2, False), (1, 3, False), (2, 3, True),
                                                  (2, 4, True), (1, 4, False), (1, 0, False)])
def test_a_standby_takes_command_with_at_least_half_of_the_node_agents(heard: int, nnodes: int, takes: bool) -> None:
    assert promotes(heard, nnodes) is takes


def test_an_agent_follows_the_candidates_in_order_and_knows_its_own() -> None:
    failover = Failover(NODE2)
    assert failover.silent() is None  # no view yet: no candidate known
    assert failover.view(JobView(S.NORMAL, standbys=(NODE1, NODE2)))
    assert failover.silent() == Move(NODE1, False, 1)
    assert failover.silent() == Move(NODE2, True, 1)  # node 1 silent too: this node's own
    assert failover.silent() is None


def test_an_unknown_candidate_is_skipped() -> None:
    failover = Failover("")
    failover.view(JobView(S.NORMAL, standbys=("", NODE2)))
    assert failover.silent() == Move(NODE2, False, 1)


def test_a_newer_term_resets_the_candidates_an_older_one_is_refused() -> None:
    failover = Failover(NODE2)
    failover.view(JobView(S.NORMAL, standbys=(NODE1, NODE2)))
    failover.silent()
    assert failover.view(JobView(S.STARTING, term=1, standbys=(NODE2,)))  # node 1's controller, standing by
    assert (failover.term, failover.standbys) == (1, (NODE2,))
    assert not failover.view(JobView(S.NORMAL, term=0))  # node 0's, back: refused
    assert not failover.accepts(0) and failover.accepts(1) and failover.accepts(2)
    assert failover.silent() == Move(NODE2, True, 2)


# ---- a standby Job ----------------------------------------------------------------------------

def standby_job() -> Job:
    """Node 1's standby for a job of two nodes of one rank (term 1), nothing heard yet."""
    return Job(2, T, 0.0, term=1, candidates=(), standing_by=True)


def test_the_first_controllers_view_says_where_its_standbys_listen_and_its_term() -> None:
    job = Job(2, T, 0.0, candidates=(1,))
    job.handle(LOCAL, AgentHello(0, (0,)), 0.0)
    out = job.handle(b"agent/1/10", AgentHello(1, (1,), address=NODE1), 0.0)
    assert out[-1].message.term == 0 and out[-1].message.standbys == (NODE1,)


def test_a_standby_commands_nothing_until_half_of_the_node_agents_follow_it_then_rebuilds_with_a_spare() -> None:
    job = standby_job()
    # Its spare follows it first: a spare is no node agent of the job, so no command yet.
    out = job.handle(SPARE, AgentHello(-1, (), spare=True), 1.0)
    assert [type(e.message) for e in out] == [JobView] and out[0].message.term == 1
    assert job.standing_by
    # Its own node's agent, in-process: its first hello says nothing of its ranks yet.
    out = job.handle(LOCAL, AgentHello(1, (1,)), 1.0)
    assert job.standing_by is False and any(isinstance(e, Promoted) and e.term == 1 for e in out)
    # Then what it runs and holds: the job was under way; node 0 has no agent: the spare gets it.
    out = job.handle(LOCAL, AgentHello(1, (1,), pids=(501,), incarnations=(0,), newest=(7,), keeper="tcp://k1:1",
                                       kept=(0,), kept_steps=(7,)), 1.1)
    (given,) = [e for e in out if isinstance(e, GiveNode)]
    assert (given.node, given.spare, given.adoption) == (0, SPARE, 1) and job.state is S.STARTING
    # The spare, now node 0's agent, says it holds nothing: the rebuild starts.
    out = job.handle(SPARE, AgentHello(0, (0,), pids=(0,), incarnations=(0,), newest=(-1,)), 1.2)
    assert job.state is S.REPAIRING
    kills = [e for e in out if isinstance(e, KillRank)]
    # Node 1's old process, which never registered with this controller (pid 0: whatever runs rank 1).
    assert [(k.rank, k.pid, k.agent) for k in kills] == [(1, 0, LOCAL)]
    out = job.handle(LOCAL, ProcessExit(1, -9, 501), 1.3)
    starts = {e.rank: e for e in out if isinstance(e, StartRank)}
    assert starts[0].restore_from == "tcp://k1:1" and starts[0].agent == SPARE
    job.handle(b"rank0.inc1", Register(0, 1, 700, (7,)), 1.5)
    job.handle(b"rank1.inc1", Register(1, 1, 701, (6, 7)), 1.5)
    assert job.state is S.ROLLBACK and job.ranks.get(0).held == (7,)


def test_a_standby_without_a_spare_waits_for_node_0s_agent() -> None:
    job = standby_job()
    job.handle(LOCAL, AgentHello(1, (1,)), 1.0)
    out = job.handle(LOCAL, AgentHello(1, (1,), pids=(501,), incarnations=(0,), newest=(7,)), 1.1)
    assert not [e for e in out if isinstance(e, (GiveNode, KillRank))] and job.state is S.STARTING


def test_once_in_command_a_standby_tells_the_controller_it_replaced_every_hello_interval() -> None:
    job = Job(2, T, 0.0, term=1, standing_by=True, supersedes="tcp://10.0.0.1:29601")
    assert not [e for e in job.tick(5.0) if isinstance(e, Fence)]  # standing by: it says nothing
    job.handle(LOCAL, AgentHello(1, (1,)), 5.0)  # half of two nodes: it commands
    assert job.next_wakeup() <= 5.0
    assert [e for e in job.tick(5.0) if isinstance(e, Fence)] == [Fence("tcp://10.0.0.1:29601", 1)]
    assert not [e for e in job.tick(6.0) if isinstance(e, Fence)]
    assert [e for e in job.tick(7.0) if isinstance(e, Fence)] == [Fence("tcp://10.0.0.1:29601", 1)]


def test_a_controller_told_of_a_newer_term_stands_down_and_makes_its_agent_a_spare_there() -> None:
    job = Job(2, T, 0.0)  # node 0 back on its old address: a controller of term 0, knowing nothing
    job.handle(LOCAL, AgentHello(0, (0,)), 0.0)
    assert job.handle(b"x", Superseded(0, "tcp://elsewhere:1"), 0.1) == []  # not newer: nothing
    out = job.handle(b"fence", Superseded(1, "tcp://10.0.0.2:29601"), 0.2)
    (told,) = [e for e in out if isinstance(e.message, Replaced)]
    assert told.peer == LOCAL and told.message.controller == "tcp://10.0.0.2:29601" and told.message.node == 0
    assert "stands down" in told.message.reason
    # From now on it commands nothing: a rank that registers hears nothing, the clock does nothing.
    assert job.handle(b"rank0.inc0", Register(0, 0, 10), 0.3) == [] and job.tick(500.0) == []
    assert job.state is S.STARTING
