"""Elastic data parallelism in the flow (:mod:`mindft.flow.elastic`): when a lost node is left behind,
what the node agents are told, and the job of the new world rebuilding from what they hold, up to
the rollback; then the agent's side of a resize (:class:`~mindft.flow.agent.NodePolicy`)."""
from __future__ import annotations

import pytest

from mindft.config import ConfigError, load_config
from mindft.flow import Broadcast, Job, JobState, KillRank, Resize, StartRank, Transition
from mindft.flow.agent import NodePolicy, Say
from mindft.flow.elastic import ElasticRange, elastic_of, new_node, parallel_refusal, successor
from mindft.flow.spares import silent_after
from mindft.protocol import ActionKind, AgentHello, JobView, OrderKind, RankOrder, Register, StepReport, WorldResize
from test_job import T, Driver

S = JobState
LOCAL, NODE1, NODE2 = b"", b"agent/1/10", b"agent/2/20"
RULES = ElasticRange(min_nodes=2, max_nodes=3, shrink_after=5.0)


def test_the_nodes_that_stay_keep_their_order_and_min_bounds_the_shrink() -> None:
    assert RULES.shrink(3, []) is None  # nothing lost
    assert RULES.shrink(3, [2]) == (0, 1)
    assert RULES.shrink(3, [0]) == (1, 2)  # node 1 becomes node 0, node 2 node 1
    assert new_node((1, 2), 2) == 1 and new_node((1, 2), 0) == -1
    assert RULES.shrink(3, [0, 2]) is None  # one node left: below MIN 2
    assert ElasticRange(1, 3, 5.0).shrink(3, [0, 2]) == (1,)


@pytest.mark.parametrize("mode, shards, refused", [
    ("data_parallel", False, ""), ("stand_alone", False, ""),
    ("semi_auto_parallel", False, "needs data parallelism, where every rank holds the whole state; parallel_mode is "
                                  "semi_auto_parallel"),
    ("auto_parallel", False, "parallel_mode is auto_parallel"),
    ("data_parallel", True, "cannot shard the optimizer state (enable_parallel_optimizer)"),
])
def test_only_data_parallelism_without_a_sharded_optimizer_may_be_elastic(mode: str, shards: bool,
                                                                           refused: str) -> None:
    elastic = load_config({"MINDFT_ELASTIC": "2:3"})
    said = parallel_refusal(elastic, mode, shards)
    assert (refused in said and said.startswith("an elastic job (MINDFT_ELASTIC=2:3)")) if refused else said == ""
    assert parallel_refusal(load_config({}), mode, shards) == ""  # not elastic: nothing to refuse


@pytest.mark.parametrize("text, nodes", [("2:4", (2, 4)), ("3", None), ("1:1", None)])
def test_the_range_is_read_once_from_the_environment(text: str, nodes) -> None:
    config = load_config({"MINDFT_ELASTIC": text, "MINDFT_SHRINK_AFTER": "12"})
    rules = elastic_of(config)
    assert (None if rules is None or rules.min_nodes == rules.max_nodes else (rules.min_nodes, rules.max_nodes)) \
        == nodes
    assert config.shrink_after == 12.0


@pytest.mark.parametrize("text", ["4:2", "0:2", "a:b", "2:", "2:3:4"])
def test_a_bad_range_names_the_variable_and_what_is_valid(text: str) -> None:
    with pytest.raises(ConfigError, match=r"MINDFT_ELASTIC: .* is not MIN:MAX nodes with 1 <= MIN <= MAX"):
        load_config({"MINDFT_ELASTIC": text})


# ---- through the Job --------------------------------------------------------------------------

def elastic_job(rules: ElasticRange = RULES, restart_scope: str = "auto") -> Driver:
    """Three nodes of one rank (node 0's agent in the controller's process), training at step 4."""
    d = Driver(3)
    d.job = Job(3, T, 0.0, elastic=rules, restart_scope=restart_scope)
    d.start()
    for peer, node in ((LOCAL, 0), (NODE1, 1), (NODE2, 2)):
        d.job.handle(peer, AgentHello(node, (node,)), d.now)
    d.steps(4)
    return d


def lose_node_2(d: Driver, until: float, node: int = 2) -> None:
    """Node 2's (or ``node``'s) agent and rank fall silent at 0; the others talk on, second by second,
    and pause when told (the job then waits for the lost rank's new process)."""
    alive = tuple(n for n in (0, 1, 2) if n != node)
    for t in range(1, int(until) + 1):
        for rank in alive:
            d.send(rank, StepReport(rank, 4))
            if rank:
                d.job.handle((NODE1, NODE2)[rank - 1], AgentHello(rank, (rank,)), float(t))
        d.at(float(t))
        if d.job.state is S.PAUSING and d.job.resized is None:
            d.ack_all(ActionKind.PAUSE, 5, held=(3, 4), ranks=alive)


def test_a_node_lost_for_good_is_left_behind_and_every_agent_is_told_the_new_world() -> None:
    d = elastic_job()
    shrink_at = silent_after(T.dead_after) + RULES.shrink_after
    lose_node_2(d, shrink_at)
    assert not [e for e in d.effects if isinstance(e, Resize)]  # lost, but waited for (a spare, its launcher)
    lose_node_2(d, shrink_at + 2)
    (resize,) = [e for e in d.effects if isinstance(e, Resize)]
    assert (resize.members, resize.lost, resize.world_size, resize.term) == ((0, 1), (2,), 2, 1)
    assert "node 2 lost for good" in resize.reason and "2 of 3 nodes (MIN 2)" in resize.reason
    (told,) = [e for e in d.effects if isinstance(e, Broadcast) and isinstance(e.message, WorldResize)]
    assert set(told.peers) == {LOCAL, NODE1, NODE2} and told.message == WorldResize(1, (0, 1), 1, resize.reason, nodes=2)
    # From now on this job commands nothing: its successor does.
    assert d.job.tick(d.now + 100) == [] and d.send(0, StepReport(0, 5)) == []


def test_below_min_the_job_waits_for_the_node_as_without_elasticity() -> None:
    d = elastic_job(ElasticRange(3, 3, 5.0))
    lose_node_2(d, 30)
    assert not [e for e in d.effects if isinstance(e, Resize)] and d.job.below_min == (2,)


def test_the_job_of_the_new_world_rebuilds_from_the_agents_memory_and_rolls_back() -> None:
    d = elastic_job()
    lose_node_2(d, 14)
    old = d.job
    job = successor(old, d.now)
    assert (job.ranks.world_size, job.term, job.state, job.goodput) == (2, 1, S.STARTING, old.goodput)
    # A hello said before its agent learnt of the resize (term 0) is not taken for the new world.
    assert job.handle(NODE1, AgentHello(1, (1,), pids=(111,), newest=(4,)), d.now) == []
    job.handle(LOCAL, AgentHello(0, (0,), pids=(0,), incarnations=(0,), newest=(4,), term=1), d.now)
    assert job.state is S.STARTING  # node 1 (node 2 before) has not said what it holds yet
    out = job.handle(NODE1, AgentHello(1, (1,), pids=(0,), incarnations=(0,), newest=(4,), term=1), d.now)
    moved = [e for e in out if isinstance(e, Transition)]
    assert moved and "node 2 lost for good" in moved[0].reason
    assert not [e for e in out if isinstance(e, KillRank) and e.pid]  # the agents stopped their ranks already
    starts = [e for e in out if isinstance(e, StartRank)]
    assert sorted((s.rank, s.agent) for s in starts) == [(0, LOCAL), (1, NODE1)]
    job.handle(b"rank0.inc1", Register(0, 1, 700, (3, 4)), d.now + 1)
    out = job.handle(b"rank1.inc1", Register(1, 1, 701, (3, 4)), d.now + 1)
    rollback = [e.message for e in out if isinstance(e, Broadcast) and getattr(e.message, "kind", None)
                is ActionKind.ROLLBACK]
    assert job.state is S.ROLLBACK and rollback[0].step == 4  # no step trained is lost


def test_an_agent_renumbers_its_ranks_and_starts_them_with_every_worker() -> None:
    policy = NodePolicy((2, 3), max_restarts=3)
    policy.on_view(JobView(S.REPAIRING, restart_all=True))
    policy.workers[2].restarts = policy.workers[3].restarts = 1
    for rank in (2, 3):
        policy.stopped(rank, -9)
    said = policy.resize((0, 1), "node 1 is node 0 of 1 now")
    assert isinstance(said[0], Say) and "renumbered 2→0, 3→1" in said[0].text
    assert sorted(policy.workers) == [0, 1] and all(w.awaiting_start and w.restarts == 1
                                                   for w in policy.workers.values())
    policy.on_view(JobView(S.STARTING, restart_all=True, term=1))
    assert policy.rebuilding
    (first,) = policy.on_order(RankOrder(0, OrderKind.START, "rebuild", term=1))
    assert first.renew_cluster and first.restarts == 2  # a new MindSpore cluster, before the first worker
    (second,) = policy.on_order(RankOrder(1, OrderKind.START, "rebuild", term=1))
    assert not second.renew_cluster


def test_a_standby_in_command_leaves_a_node_no_agent_speaks_for_behind() -> None:
    """Node 0 lost with the controller: node 1's standby takes command (term 1); no agent of node 0
    and no spare speaks to it within shrink_after: nodes 1 and 2 go on as nodes 0 and 1 (term 2)."""
    job = Job(3, T, 0.0, term=1, standing_by=True, supersedes="tcp://10.0.0.1:29601", elastic=RULES)
    job.handle(LOCAL, AgentHello(1, (1,), pids=(501,), incarnations=(0,), newest=(7,), term=0), 1.0)
    job.handle(NODE2, AgentHello(2, (2,), pids=(502,), incarnations=(0,), newest=(7,), term=0), 1.0)
    assert not job.standing_by and job.state is S.STARTING  # in command, waiting for node 0's agent
    assert not [e for e in job.tick(4.0) if isinstance(e, Resize)]
    out = job.tick(RULES.shrink_after + 0.5)
    (resize,) = [e for e in out if isinstance(e, Resize)]
    assert (resize.members, resize.lost, resize.term) == ((1, 2), (0,), 2)
    (told,) = [e for e in out if isinstance(e, Broadcast) and isinstance(e.message, WorldResize)]
    assert set(told.peers) == {LOCAL, NODE2}
    new = successor(job, RULES.shrink_after + 0.5)
    assert (new.ranks.world_size, new.term, new.supersedes) == (2, 2, job.supersedes)
    assert any(e.term == 2 for e in new.tick(RULES.shrink_after + 0.5) if hasattr(e, "address"))  # fences on
    new.handle(LOCAL, AgentHello(0, (0,), pids=(0,), incarnations=(0,), newest=(7,), term=2), 6.0)
    out = new.handle(NODE2, AgentHello(1, (1,), pids=(0,), incarnations=(0,), newest=(7,), term=2), 6.0)
    assert sorted((s.rank, s.agent) for s in out if isinstance(s, StartRank)) == [(0, LOCAL), (1, NODE2)]


def test_the_world_its_range_and_its_resizes_are_shown_by_status_metrics_and_the_event_log() -> None:
    from prometheus_client import generate_latest

    from mindft.observe.events import Event, WorldResized
    from mindft.observe.metrics import JobMetrics
    from mindft.observe.timeline import describe

    d = elastic_job()
    assert (d.job.status(d.now).nodes, d.job.status(d.now).max_nodes, d.job.status(d.now).resizes) == (3, 3, 0)
    lose_node_2(d, 14)
    (resize,) = [e for e in d.effects if isinstance(e, Resize)]
    status = successor(d.job, d.now).status(d.now)
    assert (status.world_size, status.nodes, status.min_nodes, status.max_nodes, status.resizes) == (2, 2, 2, 3, 1)
    metrics = JobMetrics()
    metrics.watch(lambda timeout=5.0: status)
    text = generate_latest(metrics.registry).decode()
    for line in ("mindft_world_size 2.0", "mindft_world_nodes 2.0", 'mindft_world_nodes_limit{limit="min"} 2.0',
                 'mindft_world_nodes_limit{limit="max"} 3.0', "mindft_world_resizes_total 1.0"):
        assert line in text, text
    record = WorldResized(list(resize.members), list(resize.lost), resize.world_size, resize.term, 4, resize.reason)
    said = describe(Event(0.0, "controller", record))
    assert said.startswith("world resized to 2 rank(s) (term 1, at step 4): node 2 lost for good")


def test_a_launcher_for_a_node_the_job_left_behind_or_renumbered_waits_as_a_spare() -> None:
    from mindft.protocol import NodeLost, Replaced

    d = elastic_job(ElasticRange(2, 3, 5.0))
    lose_node_2(d, 14)
    job = successor(d.job, d.now)
    job.handle(LOCAL, AgentHello(0, (0,), pids=(0,), newest=(4,), term=1), d.now)
    job.handle(NODE1, AgentHello(1, (1,), pids=(0,), newest=(4,), term=1), d.now)
    # Node 2's launcher, started again: the world has two nodes now.
    out = job.handle(b"agent/2/99", AgentHello(2, (2,), term=1), d.now)
    assert isinstance(out[-1].message, Replaced) and "node 2 was left behind" in out[-1].message.reason
    # After a shrink that renumbered (node 0 lost: node 1 is node 0 now), a launcher of the old node 1 that
    # thinks it replaces a lost node 1 is told that number is another agent's.
    out = job.handle(b"agent/1/98", NodeLost(1, (1,), (4,), (0,), "a new agent"), d.now)
    assert isinstance(out[-1].message, Replaced) and "node 1 is another agent's" in out[-1].message.reason
    assert job.spares.nodes[1].peer == NODE1 and job.agents[1] == NODE1  # the live agent keeps its node


def test_a_spare_joins_a_job_below_max_at_a_snapshot_boundary_from_a_peers_state() -> None:
    from mindft.flow import Send

    SPARE = b"agent/-1/30"
    d = Driver(2)
    d.job = Job(2, T, 0.0, elastic=ElasticRange(2, 3, 5.0))  # a job that shrank to two of three nodes
    d.start()
    d.job.handle(LOCAL, AgentHello(0, (0,)), 0.0)
    d.job.handle(NODE1, AgentHello(1, (1,)), 0.0)
    d.steps(4)
    assert not [e for e in d.at(1.0) if isinstance(e, Resize)]  # no spare: nothing to grow by
    d.job.handle(SPARE, AgentHello(-1, (), spare=True), 1.5)
    out = d.at(2.0)
    (resize,) = [e for e in out if isinstance(e, Resize)]
    assert (resize.members, resize.joins, resize.nnodes, resize.term) == ((0, 1), (SPARE,), 3, 1)
    (told,) = [e.message for e in out if isinstance(e, Broadcast) and isinstance(e.message, WorldResize)]
    (joins,) = [e for e in out if isinstance(e, Send) and isinstance(e.message, WorldResize)]
    assert (told.nodes, told.step, told.join) == (3, 4, -1)  # the boundary: every rank's snapshot of step 4
    assert joins.peer == SPARE and joins.message.join == 2
    new = successor(d.job, 2.0)
    assert new.ranks.world_size == 3 and new.goodput.capacity == 1.0
    new.handle(LOCAL, AgentHello(0, (0,), pids=(0,), newest=(4,), keeper="tcp://k0:1", term=1), 2.5)
    new.handle(NODE1, AgentHello(1, (1,), pids=(0,), newest=(3,), keeper="tcp://k1:1", term=1), 2.5)
    out = new.handle(SPARE, AgentHello(2, (2,), pids=(0,), newest=(-1,), keeper="tcp://k2:1", term=1), 2.5)
    starts = {s.rank: s for s in out if isinstance(s, StartRank)}
    # Its state: a copy of the peer whose newest snapshot is the oldest (step 3, which rank 0 still holds).
    assert (starts[2].restore_from, starts[2].restore_rank, starts[2].agent) == ("tcp://k1:1", 1, SPARE)
    assert starts[0].restore_from == "" and starts[0].restore_rank == -1
    for rank, peer in ((0, b"r0"), (1, b"r1"), (2, b"r2")):
        out = new.handle(peer, Register(rank, 1, 700 + rank, (3, 4) if rank == 0 else (3,)), 3.0)
    rollback = [e.message for e in out if isinstance(e, Broadcast) and getattr(e.message, "kind", None)
                is ActionKind.ROLLBACK]
    assert new.state is S.ROLLBACK and rollback[0].step == 3


# ---- found by the explorer (tests/sim_elastic.py) ----------------------------------------------

def test_a_hello_an_agent_said_before_it_learnt_of_the_resize_is_not_answered_as_its_old_node() -> None:
    """Node 1 lost for good: node 2 is node 1 now. A hello node 2's agent said before the WorldResize
    reached it names node 2, beyond the new world: answered Replaced, the agent would leave as a spare
    with its rank's memory once renumbered. It is ignored; the agent says hello again as node 1."""
    d = elastic_job()
    lose_node_2(d, 14, node=1)
    (resize,) = [e for e in d.effects if isinstance(e, Resize)]
    assert resize.members == (0, 2)
    job = successor(d.job, d.now)
    assert job.handle(NODE2, AgentHello(2, (2,), pids=(502,), newest=(4,)), d.now) == []
    job.handle(LOCAL, AgentHello(0, (0,), pids=(0,), newest=(4,), term=1), d.now)
    out = job.handle(NODE2, AgentHello(1, (1,), pids=(0,), newest=(4,), term=1), d.now)
    assert sorted((s.rank, s.agent) for s in out if isinstance(s, StartRank)) == [(0, LOCAL), (1, NODE2)]


def test_a_new_world_gives_a_silent_node_to_a_spare_only_once_it_stayed_silent_as_a_lost_one() -> None:
    """Its agents stop their ranks and rename their memory before they say hello as their new nodes: a
    spare there meanwhile does not take a node whose agent is about to speak (its memory would be lost)."""
    from mindft.flow.effects import GiveNode

    spare = b"agent/-1/30"
    d = elastic_job()
    lose_node_2(d, 14)
    job, t = successor(d.job, d.now), d.now
    job.handle(LOCAL, AgentHello(0, (0,), pids=(0,), newest=(4,), term=1), t)
    assert not [e for e in job.handle(spare, AgentHello(-1, (), spare=True), t + 0.1) if isinstance(e, GiveNode)]
    assert not [e for e in job.handle(spare, AgentHello(-1, (), spare=True), t + 3.0) if isinstance(e, GiveNode)]
    out = job.handle(spare, AgentHello(-1, (), spare=True), t + silent_after(T.dead_after) + 0.1)
    assert [(e.node, e.spare) for e in out if isinstance(e, GiveNode)] == [(1, spare)]


def test_a_spare_given_a_node_of_a_resized_world_is_heard_though_it_knows_no_term() -> None:
    """The spare a node is given to was told nothing of the resize (an AdoptNode does not raise an
    agent's term): its hello as that node is heard, or its ranks never get their orders."""
    spare = b"agent/-1/30"
    d = elastic_job()
    lose_node_2(d, 14)
    job, t = successor(d.job, d.now), d.now + silent_after(T.dead_after) + 0.1
    job.handle(LOCAL, AgentHello(0, (0,), pids=(0,), newest=(4,), term=1), t)
    job.handle(spare, AgentHello(-1, (), spare=True), t)
    job.handle(spare, AgentHello(1, (1,), pids=(0,), newest=(-1,)), t + 1)
    assert job.agents.get(1) == spare and job.state is not S.STARTING


def test_a_process_started_for_the_new_world_that_dies_before_it_registers_restarts_every_worker() -> None:
    """With collectives its peers join a new cluster it cannot join any more, and its agent waits for a
    START: taken for the exit of the process stopped before (its agent's hello said pid 0), it was
    ignored, and the agent's next hello started it alone (or the round timed out)."""
    from mindft.protocol import ProcessExit

    d = elastic_job(restart_scope="all")
    lose_node_2(d, 14)
    job = successor(d.job, d.now)
    job.handle(LOCAL, AgentHello(0, (0,), pids=(0,), newest=(4,), term=1), d.now)
    job.handle(NODE1, AgentHello(1, (1,), pids=(0,), newest=(4,), term=1), d.now)
    assert job.state is S.REPAIRING and job.recovery.round == 1
    out = job.handle(NODE1, ProcessExit(1, -9, pid=701, will_restart=True), d.now + 1)
    assert any("rank 1's new process 701 exited with code -9 before it registered" in e.reason
               for e in out if isinstance(e, Transition))
    assert job.state is S.REPAIRING and job.recovery.round == 2  # every worker restarts again
    out = job.handle(LOCAL, ProcessExit(0, -9, pid=700, will_restart=True), d.now + 1.5)  # killed as told
    assert sorted(s.rank for s in out if isinstance(s, StartRank)) == [0, 1]
