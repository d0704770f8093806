"""Warm spares in the flow: which node counts as lost (its agent and every one of its ranks silent),
which spare gets it, and how the node stays given (:mod:`mindft.flow.spares`); then the same rules
through the Job, up to the spare's ranks registering and the job rolling back."""
from __future__ import annotations

import pytest

from mindft.flow import GiveNode, JobState
from mindft.flow.spares import HELLO_INTERVAL, Spares, silent_after
from mindft.protocol import (ActionKind, AgentHello, JobView, NodeLost, Register, Replaced, Reply, StepReport)
from test_job import T, Driver

S = JobState
LOCAL, NODE1, SPARE, OTHER_SPARE, RETURNED = b"", b"agent/1/10", b"agent/-1/20", b"agent/-1/30", b"agent/1/40"


def test_a_node_is_lost_only_when_its_agent_and_every_one_of_its_ranks_are_silent() -> None:
    spares = Spares(dead_after=1.0)
    limit = silent_after(1.0)
    assert limit == 3 * HELLO_INTERVAL  # a few missed hellos, more than a rank's own dead_after here
    spares.hello(LOCAL, 0, (0,), False, 0.0)  # node 0's agent, in the controller's process: never silent
    spares.hello(NODE1, 1, (1,), False, 0.0)
    assert spares.lost_nodes(limit, {0: 0.0, 1: 0.0}) == []  # not yet: silent for exactly the limit
    assert spares.lost_nodes(limit + 0.1, {0: 0.0, 1: limit}) == []  # its rank still talks: a busy agent
    assert spares.lost_nodes(limit + 0.1, {0: 0.0, 1: 0.0}) == [1]
    spares.hello(NODE1, 1, (1,), False, limit)
    assert spares.lost_nodes(limit + 0.1, {0: 0.0, 1: 0.0}) == []  # its agent spoke


def test_a_rank_slower_to_fall_silent_than_its_agent_bounds_the_limit() -> None:
    assert silent_after(10.0) == 10.0  # never less than a rank's own dead_after


@pytest.mark.parametrize("state, given", [(S.STARTING, False), (S.NORMAL, True), (S.PAUSING, True),
                                          (S.REPAIRING, True), (S.DONE, False), (S.FAILED, False)])
def test_a_lost_node_goes_to_a_spare_only_while_the_job_trains_or_recovers(state: JobState, given: bool) -> None:
    spares = Spares(dead_after=1.0)
    spares.hello(NODE1, 1, (1,), False, 0.0)
    spares.hello(SPARE, -1, (), True, 6.0)
    made = spares.adopt(state, 6.5, {1: 0.0}, grace=20.0)
    assert [(a.node, a.peer, a.number) for a in made] == ([(1, SPARE, 1)] if given else [])


def test_the_longest_waiting_live_spare_gets_the_node_and_each_spare_one_node() -> None:
    spares = Spares(dead_after=1.0)
    for node, peer in ((1, b"a1"), (2, b"a2"), (3, b"a3")):
        spares.hello(peer, node, (node,), False, 0.0)
    spares.hello(b"stale", -1, (), True, 0.0)  # said nothing since: gone
    spares.hello(SPARE, -1, (), True, 1.0)
    spares.hello(OTHER_SPARE, -1, (), True, 2.0)
    for later in (5.0, 6.0):
        spares.hello(SPARE, -1, (), True, later)
        spares.hello(OTHER_SPARE, -1, (), True, later)
    made = spares.adopt(S.NORMAL, 7.0, {}, grace=20.0)
    assert [(a.node, a.peer) for a in made] == [(1, SPARE), (2, OTHER_SPARE)]  # node 3 waits for a spare
    assert "node 1's agent and ranks [1] silent for 7.0 s (> 6 s)" == made[0].reason
    assert spares.adopt(S.NORMAL, 8.0, {}, grace=20.0) == []  # the stale one is no spare


def test_a_node_given_away_counts_as_heard_for_the_grace_then_can_be_given_again() -> None:
    spares = Spares(dead_after=1.0)
    spares.hello(NODE1, 1, (1,), False, 0.0)
    spares.hello(SPARE, -1, (), True, 6.0)
    assert len(spares.adopt(S.NORMAL, 6.5, {}, grace=20.0)) == 1
    spares.hello(OTHER_SPARE, -1, (), True, 20.0)
    assert spares.adopt(S.NORMAL, 20.0, {}, grace=20.0) == []  # the spare fetches the replicas meanwhile
    spares.hello(OTHER_SPARE, -1, (), True, 25.0)
    spares.hello(OTHER_SPARE, -1, (), True, 30.0)
    made = spares.adopt(S.NORMAL, 33.0, {}, grace=20.0)  # the spare that took it fell silent too
    assert [(a.node, a.peer, a.number) for a in made] == [(1, OTHER_SPARE, 2)]


def test_a_node_given_away_stays_given_its_old_agent_and_launchers_are_refused() -> None:
    spares = Spares(dead_after=1.0)
    spares.hello(NODE1, 1, (1,), False, 0.0)
    spares.hello(SPARE, -1, (), True, 6.0)
    (adoption,) = spares.adopt(S.NORMAL, 6.5, {}, grace=20.0)
    assert spares.hello(SPARE, 1, (1,), False, 7.0) is None  # the spare speaks for node 1 now
    assert spares.hello(NODE1, 1, (1,), False, 8.0) == adoption  # the old agent, back from a partition
    assert spares.hello(RETURNED, 1, (1,), False, 8.0) == adoption  # a launcher started again for it
    assert spares.refuses(NodeLost(1, (1,), (5,))) == adoption
    assert spares.refuses(NodeLost(1, (1,), (5,), adoption=adoption.number)) is None  # the spare's own report
    assert spares.refuses(NodeLost(2, (2,), (5,))) is None  # a node never given away


# ---- through the Job --------------------------------------------------------------------------

def spare_job() -> Driver:
    """Two ranks on two nodes (node 0's agent in the controller's process), training, and a spare."""
    d = Driver(2).start()
    d.job.handle(LOCAL, AgentHello(0, (0,)), d.now)
    d.job.handle(NODE1, AgentHello(1, (1,)), d.now)
    d.steps(4)
    return d


def test_the_job_gives_a_silent_node_to_its_spare_and_the_spare_takes_its_ranks_over() -> None:
    d = spare_job()
    hello = d.job.handle(SPARE, AgentHello(-1, (), spare=True), d.now)
    assert [type(e.message) for e in hello] == [JobView]  # a spare hears the job's view
    limit = silent_after(T.dead_after)
    for t in range(1, int(limit) + 2):  # rank 0 and node 0 talk on; node 1 and rank 1 went silent
        d.send(0, StepReport(0, 4))
        d.job.handle(SPARE, AgentHello(-1, (), spare=True), float(t))
        d.at(float(t))
    given = [e for e in d.effects if isinstance(e, GiveNode)]
    assert [(g.node, g.spare, g.adoption) for g in given] == [(1, SPARE, 1)]
    assert d.job.state is S.PAUSING  # rank 1 was found silent first (a hang)
    # Only the spare's report of the node counts; a launcher of node 1 started meanwhile is refused.
    refused = d.job.handle(RETURNED, NodeLost(1, (1,), (4,), (0,), "new agent"), d.now)
    assert isinstance(refused[-1].message, Replaced) and "given to a spare (adoption 1" in refused[-1].message.reason
    out = d.job.handle(SPARE, NodeLost(1, (1,), (4,), (0,), "node 1 given to a spare", adoption=1), d.now)
    assert isinstance(out[-1].message, Reply) and out[-1].message.ok
    assert [r.state for r in d.job.status(d.now).ranks][1] == "lost"
    d.job.handle(SPARE, AgentHello(1, (1,), pids=(0,)), d.now)
    d.ack_all(ActionKind.PAUSE, 5, held=(3, 4), ranks=(0,))
    assert d.job.state is S.REPAIRING  # for rank 1's process on the spare
    d.send(1, Register(1, 1, 301, (4,)), incarnation=1)
    assert d.job.state is S.ROLLBACK and d.actions(ActionKind.ROLLBACK)[-1].step == 4  # its replica's step
    # The old agent of node 1, back, is told it was replaced.
    back = d.job.handle(NODE1, AgentHello(1, (1,), pids=(111,)), d.now)
    assert [type(e.message) for e in back] == [Replaced]


def test_without_a_spare_a_silent_node_is_given_to_nobody() -> None:
    d = spare_job()
    for t in range(1, 20):
        d.send(0, StepReport(0, 4))
        d.at(float(t))
    assert not [e for e in d.effects if isinstance(e, GiveNode)]


def test_a_spare_that_follows_a_newer_term_is_given_nothing_by_an_older_controller() -> None:
    """Found on three hosts: after a partition around node 0 healed, the spare's hello (it follows
    term 1) reached node 0's controller (term 0) before Superseded did, and that controller gave
    node 1 to it. A spare that follows a newer term is not this controller's."""
    d = spare_job()
    limit = silent_after(T.dead_after)
    for t in range(1, int(limit) + 2):
        d.send(0, StepReport(0, 4))
        assert d.job.handle(SPARE, AgentHello(-1, (), spare=True, term=1), float(t)) == []
        d.at(float(t))
    assert not [e for e in d.effects if isinstance(e, GiveNode)]


def test_a_spare_heard_again_after_a_silence_counts_once_heard_a_while_later() -> None:
    """Found on three hosts: the hellos a spare sent into a partition, before it followed the standby,
    arrived at once when the link healed, and the superseded controller gave it a node."""
    spares = Spares(dead_after=1.0)
    spares.hello(NODE1, 1, (1,), False, 0.0)
    spares.hello(SPARE, -1, (), True, 0.0)
    spares.hello(SPARE, -1, (), True, 15.0)  # two held-back hellos, delivered together
    spares.hello(SPARE, -1, (), True, 15.001)
    assert spares.adopt(S.NORMAL, 15.1, {1: 0.0}, grace=20.0) == []
    spares.hello(SPARE, -1, (), True, 17.0)  # a spare that is really back says hello again
    assert [a.node for a in spares.adopt(S.NORMAL, 17.1, {1: 0.0}, grace=20.0)] == [1]
